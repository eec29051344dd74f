"""The evidence run: one warm start, then off / R2 / R3 (and a noise floor) as GRPO arms side by side.

Layout of the run folder (``--out``)::

    run.json                 everything the arms read (model, task, options, arms, deadline)
    model/config.json        the HF config vLLM starts from (dummy weights, synced before step 0)
    warmstart/state.pt       the supervised warm start (HF names, fp32); stats.json and spec.json (what it
                             was trained for, state.pt's sha256) next to it: ``--warm-start`` reuses the folder
    logs/<arm>.jsonl         one line per step, verl's file-logger format (r3bridge.demo.grpo)
    logs/<arm>.json          the arm's options and final status
    procs/<i>.log            stdout / stderr of arm process i
    ckpt/<arm>.pt            the latest resumable checkpoint (--resume continues from it)
    calib/<candidate>/       with --calibrate: each candidate's own small run (the same layout)
    calibration.json         with --calibrate: every candidate's numbers, the choice and its reason

**Calibration** (:func:`calibrate`): before the run, every candidate model (a shape and the warm
start's router knobs) warm-starts in its own process, side by side, then runs one short ``off``
arm through the run's engine: the trainer's own top-k at theta_old against the engine's routes
(``route/native_vs_engine``, per layer too), the router margins, the warm start's accuracy and the
step time. The run then takes the first candidate, in the given order (cheapest first), whose
agreement is at most ``max_agreement``, whose warm start reached its target accuracy and whose
estimated run fits the time left (:func:`_estimate_runs`: the slowest arm's step - the calibration
arm's, its update phase scaled to the most mini-batches an arm has - x the run's steps, bound by the
cores: x ``side_by_side``, the step being Python-bound, one core per arm (10 arms of the 4-layer
model took 1.0-1.3 s per step side by side, CPU time = wall time); or by the GPU: the run's arms
x each arm's share of the GPU's measured busy time). It reuses that candidate's warm start. When none
qualifies it says so and takes the least-agreeing one that fits (else the fastest).

Why processes, side by side on one GPU: the model is a few MB, so each arm's kernels are tiny
and launch-bound; the step time is the Python of megatron's schedule, the replay bookkeeping and
vLLM's scheduler, one CPU core each. Arms as processes run those on separate cores while the GPU
interleaves their kernels, give every arm its own CUDA context, megatron parallel state and vLLM
engine, and keep a failing arm from taking the others down. The arm processes start while the
warm start trains (vLLM starts on dummy weights) and wait for its weights.

``python -m r3bridge.demo.evidence RUN_DIR ARM...`` is one arm process (the orchestrator starts
it): the named arms, one after the other, the process itself being a one-rank megatron world.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from r3bridge.demo.evidence_config import (
    WARM_START_FILES,
    Arm,
    Candidate,
    EvidenceError,
    RunConfig,
    sha256_of,
    write_warm_start_spec,
)
from r3bridge.demo.warmstart import EvidenceModelShape


def _write_model_dir(root: Path, shape: EvidenceModelShape) -> None:
    cfg = shape.hf_config()
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(root / "model")


def _run_warm_start(root: Path, run: RunConfig, device: str, log: Callable[[str], None]) -> None:
    import torch

    from r3bridge.demo.warmstart import warm_start

    ws = root / "warmstart"
    if device == "cpu":
        # the arm processes share the CPU: more intra-op threads only spin (4x the CPU time, measured)
        torch.set_num_threads(1)
    try:
        state, stats = warm_start(run.shape, run.task, run.warm, device=device, log=log)
    except BaseException as e:
        (ws / "FAILED").write_text(f"{type(e).__name__}: {e}")
        raise
    torch.save(state, ws / "state.tmp")
    spec = write_warm_start_spec(ws, run, ws / "state.tmp")
    (ws / "stats.json").write_text(json.dumps(stats, indent=1))
    os.replace(ws / "state.tmp", ws / "state.pt")
    run.warm_start_sha256 = spec["state_sha256"]
    log(f"[evidence] warm start: greedy accuracy {stats['greedy_accuracy']:.3f} in {stats['seconds']:.0f} s")


def _launch(root: Path, names: list[str], index: int, gpu: Optional[int]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    out = open(root / "procs" / f"{index}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "r3bridge.demo.evidence", str(root), *names], stdout=out,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Each arm process leads its own session: end the sessions this run started, by their ids."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    end = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _stderr(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def source_commit() -> Optional[str]:
    """The r3bridge commit this run is made from: ``R3BRIDGE_COMMIT`` when set (a copied tree, as on
    the device: its .git, where the copy has one, can be older than the files - 2026-11-29's device
    copy reported 469d207 for 33cfc8e's files), else git's HEAD where this package is a checkout's
    (``-dirty`` when its files differ from HEAD), else None (the report says unknown)."""
    if os.environ.get("R3BRIDGE_COMMIT"):
        return os.environ["R3BRIDGE_COMMIT"]
    package = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *argv], cwd=package, capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        # an installed package inside some other repository (a venv in a checkout) is not that repository's code
        if top.returncode == 0 and (Path(top.stdout.strip()) / "r3bridge").resolve() == package:
            head = git("rev-parse", "HEAD").stdout.strip()
            if head:
                dirty = git("diff", "--quiet", "HEAD", "--", ".").returncode != 0
                return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


# the distributions whose code computes a step (engine, trainer, their kernels); an absent one is None
VERSIONED = ("torch", "transformers", "megatron-core", "vllm", "transformer-engine", "triton")


def run_versions(device: str) -> dict[str, Optional[str]]:
    """The installed releases of :data:`VERSIONED` (read from their metadata, nothing imported)
    and, on cuda, the GPU's name: arms of two sessions compare only if these are the same. A
    Transformer Engine installed beside the local layer spec changes no kernel megatron-core runs
    with its fusions off, but the report cannot check that, so it is recorded like the rest."""
    from importlib import metadata

    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if device == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def run(root: Path, run: RunConfig, *, device: str, procs: int, gpus: int, wall_s: float,
        log: Callable[[str], None] = _stderr, warm_from: Optional[Path] = None) -> dict[str, Any]:
    """The whole run, bounded by ``wall_s`` seconds; returns each arm's status and steps.
    ``warm_from``: a warm start folder to reuse (the calibration's, or ``--warm-start``'s from an
    earlier session), instead of training one."""
    t0 = time.time()
    for sub in ("logs", "warmstart", "procs", "ckpt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    run.deadline = t0 + wall_s
    run.commit = source_commit()
    run.versions = run_versions(device)
    _write_model_dir(root, run.shape)
    if warm_from is not None and warm_from.resolve() != (root / "warmstart").resolve():
        for name in WARM_START_FILES:         # state.pt last: the arms wait for it
            shutil.copyfile(warm_from / name, root / "warmstart" / f"{name}.tmp")
            os.replace(root / "warmstart" / f"{name}.tmp", root / "warmstart" / name)
    have_warm = warm_from is not None or (run.resume and (root / "warmstart" / "state.pt").exists())
    if not have_warm:
        for stale in ("state.pt", "FAILED"):
            (root / "warmstart" / stale).unlink(missing_ok=True)
    else:
        run.warm_start_sha256 = sha256_of(root / "warmstart" / "state.pt")
    run.save(root)
    names = [a.name for a in run.arms]
    groups = [names[i::procs] for i in range(min(procs, len(names)))]
    children = [_launch(root, g, i, (i % gpus) if gpus > 1 else None) for i, g in enumerate(groups)]
    log(f"[evidence] {len(run.arms)} arm(s) in {len(children)} process(es): {groups}; bound {wall_s:.0f} s")
    try:
        if not have_warm:
            _run_warm_start(root, run, device, log)
            run.save(root)          # with the warm start's sha256 (the arms read only what they read before)
        reported, failed = time.time(), set()
        while any(p.poll() is None for p in children) and time.time() < run.deadline + 60:
            time.sleep(1.0)
            if time.time() - reported >= 30:      # the pace shows early in a bounded run
                reported = time.time()
                _progress(root, names, log, t0)
                for i, p in enumerate(children):
                    if p.returncode and i not in failed:     # say it now, not only at the end
                        failed.add(i)
                        log(f"[evidence] arm process {i} ({', '.join(groups[i])}) exited with {p.returncode}: "
                            f"see {root / 'procs' / f'{i}.log'}")
    finally:
        _stop(children)
    summary = {n: _arm_summary(root, n) for n in names}
    for i, p in enumerate(children):
        if p.returncode:
            tail = (root / "procs" / f"{i}.log").read_text().strip().splitlines()[-12:]
            log(f"[evidence] arm process {i} ({', '.join(groups[i])}) exited with {p.returncode}:\n  "
                + "\n  ".join(tail))
    log(f"[evidence] done in {time.time() - t0:.0f} s: " + ", ".join(f"{n} {s['steps']} steps ({s['status']})"
                                                                  for n, s in summary.items()))
    return summary


def _progress(root: Path, names: list[str], log: Callable[[str], None], t0: float) -> None:
    """One line: steps done per arm and its last step time."""
    parts = []
    for n in names:
        lines = _tail_lines(root / "logs" / f"{n}.jsonl")
        if lines:
            last = json.loads(lines[-1])
            parts.append(f"{n}:{last['step'] + 1}@{last['data'].get('timing_s/step', 0):.2f}s")
    log(f"[evidence] {time.time() - t0:.0f} s: " + (" ".join(parts) or "arms starting"))


def _tail_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line.strip()]


def _arm_summary(root: Path, name: str) -> dict[str, Any]:
    meta_path = root / "logs" / f"{name}.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    status = meta.get("status", "never started")
    if status == "running":
        status = "killed at the wall-clock bound"
    return {"status": status, "steps": len(_tail_lines(root / "logs" / f"{name}.jsonl"))}


# ---------------------------------------------------------------------------------- calibration
STARTUP_S = 90.0      # an arm process's start before its first step: imports, engine, trainer (H200, measured ~60 s)


def calibrate(root: Path, base: RunConfig, candidates: Sequence[Candidate], *, device: str, wall_s: float,
              max_agreement: float, run_deadline: float, side_by_side: float = 1.3, steps: int = 2,
              log: Callable[[str], None] = _stderr) -> dict[str, Any]:
    """Every candidate's short run side by side (each its own process: a warm start, then one
    ``off`` arm of ``steps`` steps through the run's engine), then the choice for a run that must
    end by ``run_deadline`` (unix time). Writes and returns ``calibration.json``'s content:
    ``candidates`` (one row each, in the given order), ``chosen``, ``goal_met`` and ``reason``."""
    if not candidates:
        raise EvidenceError("calibration needs at least one candidate")
    engine = next((a.engine for a in base.arms if a.engine != "self"), "hf")
    t0 = time.time()
    gate = root / "calib" / "GO"
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.unlink(missing_ok=True)
    children: list[tuple[Candidate, Path, subprocess.Popen]] = []
    outs = []
    for cand in candidates:
        d = root / "calib" / cand.name
        d.mkdir(parents=True, exist_ok=True)
        cfg = RunConfig(shape=cand.shape, task=base.task, warm=cand.warm(base.warm),
                        grpo=dataclasses.replace(cand.grpo(base.grpo), steps=steps, checkpoint_every=0),
                        arms=[Arm("off-s0", "off", 0, engine)], start_gate=str(gate))
        (d / "logs" / "off-s0.ready").unlink(missing_ok=True)
        cfg.save(d)
        out = open(d / "orchestrator.log", "w")
        outs.append(out)
        cmd = [sys.executable, "-m", "r3bridge.demo.evidence", "--orchestrate", str(d), device, str(wall_s)]
        children.append((cand, d, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                   env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                                   start_new_session=True)))
    log(f"[calibrate] {len(children)} candidate(s) side by side, bound {wall_s:.0f} s: "
        + ", ".join(c.name for c in candidates))
    try:
        while any(p.poll() is None for *_, p in children) and time.time() < t0 + wall_s + 60:
            time.sleep(1.0)
            # every candidate's arm built (or its process gone), or 3/4 of the bound spent: all
            # step together, so each one's step time and the GPU's busy share are side by side
            ready = [(d / "logs" / "off-s0.ready").exists() or p.poll() is not None for _, d, p in children]
            if not gate.exists() and (all(ready) or time.time() > t0 + 0.75 * wall_s):
                gate.touch()
                log(f"[calibrate] {sum(ready)} of {len(ready)} candidate(s) ready after {time.time() - t0:.0f} s: "
                    "their steps start together")
    finally:
        _stop([p for *_, p in children])
        for out in outs:
            out.close()
    # the slowest arm has the most mini-batches: its update phase is that many over the calibration arm's
    mb_scale = max([base.mini_batches(a) for a in base.arms] or [base.grpo.mini_batches]) / base.grpo.mini_batches
    rows = [_candidate_row(cand, d, p.returncode, mb_scale) for cand, d, p in children]
    _estimate_runs(rows, base.grpo.steps, len(base.arms), side_by_side)
    result = choose(rows, max_agreement, budget_s=run_deadline - time.time() - STARTUP_S)
    result["seconds"] = time.time() - t0
    (root / "calibration.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        log(f"[calibrate] {r['name']}: agreement {_num(r['agreement'])} (min layer {_num(r['agreement_min_layer'])}), "
            f"warm-start accuracy {_num(r['accuracy'])} in {_num(r['warm_seconds'])} s, margin median "
            f"{_num(r['margin_median'])} ({_num(r['margin_below'])} under {r['margin_threshold']}), step "
            f"{_num(r['step_s'])} s, GPU {_num(r['gpu_utilization'])} % busy (the run ~{_num(r['run_s_estimate'])} s, "
            f"bound by its {r['bound_by']}){'' if r['ran'] else ': ' + r['error']}")
    log(f"[calibrate] chose {result['chosen']}: {result['reason']}")
    return result


def _num(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def _estimate_runs(rows: list[dict[str, Any]], steps: int, arms: int, side_by_side: float) -> None:
    """Each candidate's estimated run, the longer of two bounds: its cores (the slowest arm's step,
    x ``side_by_side`` when the run has more arms than the calibration had candidates side by side;
    with as many or fewer the calibration's step already bears that load) and the GPU (every arm's
    share of the busy GPU: the utilization measured during its calibration steps, split evenly
    among the candidates that ran side by side, times the run's arms; kernels of different
    processes take turns on one GPU). Calibration 4 (H200): L4-E64-k8 stepped 2.69 s among 6
    candidates and 2.0-2.4 s as one of 4 arms; x 1.3 there estimated 1,050 s for a run that took
    657 s, and the only candidate under 0.95 was passed over for not fitting 970 s."""
    side = max(1, sum(1 for r in rows if r["ran"]))
    for r in rows:
        if not r["ran"]:
            continue
        r["run_s_alone"] = r["step_s"] * steps
        cores = r["slowest_step_s"] * (side_by_side if arms > side else 1.0)
        gpu = None if r["gpu_utilization"] is None else arms * r["gpu_utilization"] / 100 / side * r["slowest_step_s"]
        r["run_s_estimate"] = max(cores, gpu or 0.0) * steps
        r["bound_by"] = "GPU" if gpu is not None and gpu > cores else "cores"


def _candidate_row(cand: Candidate, d: Path, returncode: Optional[int], mb_scale: float) -> dict[str, Any]:
    """What a candidate's short run measured (None where it did not get that far)."""
    stats_path = d / "warmstart" / "stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    lines = _tail_lines(d / "logs" / "off-s0.jsonl")
    data = [json.loads(line)["data"] for line in lines]
    margins = stats.get("router_margins", {})
    row: dict[str, Any] = {
        "name": cand.name, "shape": dataclasses.asdict(cand.shape), "aux_loss": cand.aux_loss,
        "router_z_loss": cand.router_z_loss, "lr": cand.lr, "trainer_dtype": cand.trainer_dtype, "ran": bool(data), "steps": len(data),
        "accuracy": stats.get("greedy_accuracy"), "target_accuracy": stats.get("options", {}).get("target_accuracy"),
        "warm_steps": stats.get("steps"), "warm_seconds": stats.get("seconds"),
        "warm_margin_median": margins.get("median"), "warm_margin_below": margins.get("below"),
        "margin_threshold": margins.get("threshold"), "agreement": None, "agreement_per_layer": {},
        "agreement_min_layer": None, "margin_median": None, "margin_below": None, "step_s": None,
        "run_s_alone": None, "slowest_step_s": None, "gpu_utilization": None, "run_s_estimate": None,
        "bound_by": None, "reward": None, "error": ""}
    if data:
        mean = lambda key: sum(x[key] for x in data) / len(data)        # noqa: E731
        row["agreement"] = mean("route/native_vs_engine")
        per_layer = {k.rsplit("layer", 1)[1]: mean(k) for k in data[0] if k.startswith("route/native_vs_engine/layer")}
        row["agreement_per_layer"] = per_layer
        row["agreement_min_layer"] = min(per_layer.values()) if per_layer else None
        row["margin_median"], row["margin_below"] = mean("route/margin/median"), mean("route/margin/below")
        row["reward"] = mean("critic/score/mean")
        # the last step: the first one pays for allocations and the engine's first batch
        row["step_s"] = data[-1]["timing_s/step"]
        row["slowest_step_s"] = row["step_s"] + data[-1]["timing_s/update_actor"] * max(0.0, mb_scale - 1.0)
        if "perf/gpu_utilization" in data[-1]:
            row["gpu_utilization"] = data[-1]["perf/gpu_utilization"]
    else:
        failed = d / "warmstart" / "FAILED"
        tail = (d / "orchestrator.log").read_text().strip().splitlines()[-3:] if (d / "orchestrator.log").exists() else []
        row["error"] = (failed.read_text().strip() if failed.exists() else
                        f"no step logged (exit {returncode}): " + " | ".join(tail))
    return row


def choose(rows: list[dict[str, Any]], max_agreement: float, budget_s: float = math.inf) -> dict[str, Any]:
    """The first row (in order) that ran, reached its warm start's target accuracy, agrees at
    most ``max_agreement`` and whose estimated run fits ``budget_s``; else, said to miss the goal,
    the least-agreeing row that fits among those that reached the target accuracy (else half of
    it, else any), or the fastest when none fits."""
    ran = [r for r in rows if r["ran"]]
    if not ran:
        raise EvidenceError("calibration: no candidate ran a step: " + "; ".join(f"{r['name']}: {r['error']}" for r in rows))
    out = {"candidates": rows, "max_agreement": max_agreement, "budget_s": budget_s}
    for r in ran:
        reached = r["accuracy"] is not None and r["accuracy"] >= (r["target_accuracy"] or 0.0)
        if reached and r["agreement"] <= max_agreement and r["run_s_estimate"] <= budget_s:
            return {**out, "chosen": r["name"], "goal_met": True,
                    "reason": f"the first candidate whose route agreement ({r['agreement']:.4f}) is at most "
                              f"{max_agreement}, whose warm start reached {r['target_accuracy']} greedy accuracy "
                              f"({r['accuracy']:.3f}) and whose run (~{r['run_s_estimate']:.0f} s) fits the "
                              f"{budget_s:.0f} s left"}
    fits = [r for r in ran if r["run_s_estimate"] <= budget_s]
    # GRPO needs signal before disagreement is worth anything: among those that fit, the ones that
    # reached the target, else at least half of it, else any
    acc = lambda r, frac: r["accuracy"] is not None and r["accuracy"] >= frac * (r["target_accuracy"] or 0.0)  # noqa: E731
    pool = next((p for p in ([r for r in fits if acc(r, 1.0)], [r for r in fits if acc(r, 0.5)], fits) if p), [])
    best = min(pool, key=lambda r: r["agreement"]) if pool else min(ran, key=lambda r: r["run_s_estimate"])
    return {**out, "chosen": best["name"], "goal_met": False,
            "reason": f"GOAL NOT MET: no candidate agreed at most {max_agreement}, reached its warm start's target "
                      f"accuracy and fits the {budget_s:.0f} s left; running "
                      + (f"the least-agreeing one that fits, preferring those nearest the target accuracy "
                         f"({best['agreement']:.4f}, accuracy {_num(best['accuracy'])}, ~{best['run_s_estimate']:.0f} s)"
                         if pool else
                         f"the fastest ({best['name']}, ~{best['run_s_estimate']:.0f} s): the run will be cut short")}


def _orchestrate(argv: list[str]) -> int:
    """``--orchestrate DIR DEVICE WALL_S``: a calibration candidate's run (its run.json written).
    Ended by the calibration at its bound, it still ends its own arm process (``run``'s finally)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    d, device, wall_s = Path(argv[0]), argv[1], float(argv[2])
    summary = run(d, RunConfig.load(d), device=device, procs=1, gpus=1, wall_s=wall_s)
    return 0 if all(s["steps"] for s in summary.values()) else 1


def _arm_process(argv: list[str]) -> int:
    """This process is one rank running the named arms (the orchestrator ends it at the bound)."""
    from r3bridge.demo.grpo import run_arms
    from r3bridge.testing.harness.dist import run_as_only_rank

    root, names = Path(argv[0]), argv[1:]
    cuda = RunConfig.load(root).grpo.device == "cuda"
    status = run_as_only_rank(run_arms, args=(str(root), names), backend="nccl" if cuda else "gloo")
    print(json.dumps(status), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--orchestrate"]:
        raise SystemExit(_orchestrate(sys.argv[2:]))
    raise SystemExit(_arm_process(sys.argv[1:]))
