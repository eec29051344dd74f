"""The evidence run: one warm start, then off / R2 / R3 (and a noise floor) as GRPO arms side by side.

Layout of the run folder (``--out``)::

    run.json                 everything the arms read (model, task, options, arms, deadline)
    model/config.json        the HF config vLLM starts from (dummy weights, synced before step 0)
    warmstart/state.pt       the supervised warm start (HF names, fp32); stats.json next to it
    logs/<arm>.jsonl         one line per step, verl's file-logger format (r3bridge.demo.grpo)
    logs/<arm>.json          the arm's options and final status
    procs/<i>.log            stdout / stderr of arm process i
    ckpt/<arm>.pt            the latest resumable checkpoint (--resume continues from it)

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

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from r3bridge.demo.evidence_config import RunConfig
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
    os.replace(ws / "state.tmp", ws / "state.pt")
    (ws / "stats.json").write_text(json.dumps(stats, indent=1))
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


def run(root: Path, run: RunConfig, *, device: str, procs: int, gpus: int, wall_s: float,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """The whole run, bounded by ``wall_s`` seconds; returns each arm's status and steps."""
    t0 = time.time()
    for sub in ("logs", "warmstart", "procs", "ckpt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    run.deadline = t0 + wall_s
    _write_model_dir(root, run.shape)
    have_warm = run.resume and (root / "warmstart" / "state.pt").exists()
    if not have_warm:
        for stale in ("state.pt", "FAILED"):
            (root / "warmstart" / stale).unlink(missing_ok=True)
    run.save(root)
    names = [a.name for a in run.arms]
    groups = [names[i::procs] for i in range(min(procs, len(names)))]
    children = [_launch(root, g, i, (i % gpus) if gpus > 1 else None) for i, g in enumerate(groups)]
    log(f"[evidence] {len(run.arms)} arm(s) in {len(children)} process(es): {groups}; bound {wall_s:.0f} s")
    try:
        if not have_warm:
            _run_warm_start(root, run, device, log)
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
    raise SystemExit(_arm_process(sys.argv[1:]))
