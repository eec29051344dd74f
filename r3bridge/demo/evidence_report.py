"""Reading an evidence run's logs back: the table (ratios after warm-up, drift, collapse, seeds),
issue 49's goals met or not, and the figure (per-step curves per metric, arms coloured, seeds
thin, their mean thick).

Reads ``<arm>.jsonl`` or ``<arm>.jsonl.gz`` (verl's file-logger lines ``{"step", "data"}``) from a
run folder, its ``logs/`` or any folder of such files; an arm's group is its name before ``-s<seed>``
(``off-s1`` -> ``off``, ``R3-mb8-s0`` -> ``R3-mb8``). Several runs (device sessions) merge into
one table where they loaded the same warm start (:func:`load_runs`). Plain Python; ``r3bridge evidence plot``
(r3bridge/cli/evidence.py) draws.
"""
from __future__ import annotations

import gzip
import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

# (key, label, lower_is_better, log_scale): the figure's panels and the table's rows, in order
METRICS: list[tuple[str, str, Optional[bool], bool]] = [
    ("actor/r3bridge/old_log_prob/mismatch/k3_kl", "k3 KL, train vs rollout (compute_log_prob)", True, True),
    ("actor/r3bridge/old_log_prob/mismatch/F2", "F(2), train vs rollout (compute_log_prob)", True, True),
    ("actor/r3bridge/update/mismatch/k3_kl", "k3 KL, update forwards vs rollout", True, True),
    ("route/native_vs_engine", "route agreement: trainer's own top-k vs engine's", False, False),
    ("actor/first_update/abs_log_ratio", "|log ratio| of the first update (theta_old)", True, True),
    ("actor/grad_norm/p50", "gradient norm p50 (the step's updates)", None, True),
    ("actor/grad_norm/p99", "gradient norm p99 (the step's updates)", None, True),
    ("critic/score/mean", "reward (exact match)", False, False),
    ("actor/entropy", "entropy (nats / token)", None, False),
    ("route/margin/median", "router margin median, k-th - (k+1)-th logit (native arms)", None, True),
]
# (numerator, denominator) groups whose per-metric ratio the table shows, where both ran: off
# against each replay; R2 against R3 at 1, 4 and 8 mini-batches (arXiv 2512.01374: R2 better at
# few mini-batches per rollout batch, R3 at 4 and 8)
PAIRS = (("off", "R3"), ("off", "R2"), ("off", "R3w"), ("R3", "R3w"),
         ("R2-mb1", "R3-mb1"), ("R2", "R3"), ("R2-mb8", "R3-mb8"))
K3, F2, P99, AGREE = ("actor/r3bridge/old_log_prob/mismatch/k3_kl", "actor/r3bridge/old_log_prob/mismatch/F2",
                      "actor/grad_norm/p99", "route/native_vs_engine")
# issue 49's goals: (label, pair, metric, at least) and off's agreement at most 0.95
GOALS = (("R3's k3 KL (compute_log_prob) >= 5x below off's", ("off", "R3"), K3, 5.0),
         ("R3's F(2) (compute_log_prob) >= 10x below off's", ("off", "R3"), F2, 10.0),
         ("off's gradient-norm p99 >= 3x R3's", ("off", "R3"), P99, 3.0))
MAX_OFF_AGREEMENT = 0.95
MIN_POSITIVE = 1e-12      # floor for log axes and ratios: a metric that is exactly 0


@dataclass
class ArmLog:
    name: str
    group: str
    seed: Optional[int]
    steps: list[int]
    data: list[dict[str, float]]

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, d[key]) for s, d in zip(self.steps, self.data) if key in d]


_ARM = re.compile(r"^(?P<group>.+?)-s(?P<seed>\d+)$")


def _log_lines(f: Path, *, while_written: bool = False) -> list[dict[str, Any]]:
    """An arm's ``{"step", "data"}`` lines from ``<arm>.jsonl`` or ``.jsonl.gz``. ``while_written``:
    the arm may be writing its last line right now, so a line that does not parse is skipped."""
    opener = gzip.open if f.name.endswith(".gz") else open
    rows = []
    with opener(f, "rt") as fp:
        for line in fp:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                if not while_written:
                    raise
    return rows


def load_logs(path: str | Path) -> list[ArmLog]:
    root = Path(path)
    if (root / "logs").is_dir():
        root = root / "logs"
    files = sorted(set(root.glob("*.jsonl")) | set(root.glob("*.jsonl.gz")))
    if not files:
        raise FileNotFoundError(f"no <arm>.jsonl or <arm>.jsonl.gz in {root}")
    arms = []
    for f in files:
        name = f.name[: -len(".jsonl.gz")] if f.name.endswith(".gz") else f.stem
        rows = _log_lines(f)
        m = _ARM.match(name)
        arms.append(ArmLog(name, m.group("group") if m else name, int(m.group("seed")) if m else None,
                           [int(r["step"]) for r in rows], [r["data"] for r in rows]))
    return arms


# run.json's GRPO options that may differ between runs merged into one table: the KV cache is sized
# from the largest calibration candidate (twice every sample at full length: the same batching either
# way) and checkpoints change nothing a step computes
MERGE_IGNORES = ("vllm_kv_cache_mb", "checkpoint_every")


def _run_json(path: Path) -> Optional[dict[str, Any]]:
    """The run.json of a run folder, or the one next to a logs folder (``collect`` copies it there)."""
    root = Path(path)
    for candidate in (root / "run.json", root.parent / "run.json"):
        if candidate.exists():
            return json.loads(candidate.read_text())
    return None


def load_runs(paths: list[str | Path]) -> tuple[list[ArmLog], list[dict[str, Any]]]:
    """The arms of one or several runs (e.g. one per device session), and per run where its arms
    came from: folder, the warm start's sha256, the commit, its arms. Several runs merge only where
    every one says which warm start it loaded, all loaded the same one, with the same model, task
    and GRPO options, and no arm name repeats; else :class:`EvidenceError` names what differs."""
    from r3bridge.demo.evidence_config import EvidenceError, GRPOOptions
    from r3bridge.demo.task import AdditionTask
    from r3bridge.demo.warmstart import EvidenceModelShape

    arms: list[ArmLog] = []
    runs: list[dict[str, Any]] = []
    for p in paths:
        got = load_logs(p)
        info = _run_json(Path(p))
        runs.append({"folder": str(p), "warm_start_sha256": (info or {}).get("warm_start_sha256"),
                     "commit": (info or {}).get("commit"), "versions": (info or {}).get("versions"),
                     "arms": [a.name for a in got], "run_json": info})
        arms += got
    if len(runs) > 1:
        unknown = [r["folder"] for r in runs if not r["warm_start_sha256"]]
        if unknown:
            raise EvidenceError(f"cannot merge runs: {', '.join(unknown)} says no warm start sha256 (no run.json "
                                "beside its logs, or a run from before runs recorded it)")
        first = runs[0]
        defaults = {part: asdict(kind()) for part, kind in
                    (("shape", EvidenceModelShape), ("task", AdditionTask), ("grpo", GRPOOptions))}
        for r in runs[1:]:
            if r["warm_start_sha256"] != first["warm_start_sha256"]:
                raise EvidenceError(f"cannot merge runs: {r['folder']}'s warm start {r['warm_start_sha256'][:12]} is "
                                    f"not {first['folder']}'s {first['warm_start_sha256'][:12]} (arms from different "
                                    "warm starts do not compare)")
            bad = []
            for part in ("shape", "task", "grpo"):
                # an option a run predates is its default (router_losses came after 33cfc8e's arms)
                want = {**defaults[part], **first["run_json"][part]}
                want = {k: v for k, v in want.items() if k not in MERGE_IGNORES}
                have = {**defaults[part], **r["run_json"][part]}
                bad += [f"{part}.{k} ({want[k]!r} vs {have.get(k)!r})" for k in want if have.get(k) != want[k]]
            if bad:
                raise EvidenceError(f"cannot merge runs: {first['folder']} and {r['folder']} differ in "
                                    + "; ".join(bad))
            # what computed the steps (runs from before run.json recorded it: not checkable, shown as unknown)
            if first["versions"] and r["versions"]:
                other = [f"{k} ({first['versions'].get(k)} vs {r['versions'].get(k)})"
                         for k in sorted(set(first["versions"]) | set(r["versions"]))
                         if first["versions"].get(k) != r["versions"].get(k)]
                if other:
                    raise EvidenceError(f"cannot merge runs: {first['folder']} and {r['folder']} ran on different "
                                        "software or GPUs: " + "; ".join(other))
        seen: dict[str, str] = {}
        for r in runs:
            for n in r["arms"]:
                if n in seen:
                    raise EvidenceError(f"cannot merge runs: arm {n} is in both {seen[n]} and {r['folder']}")
                seen[n] = r["folder"]
    for r in runs:
        r.pop("run_json")
    return arms, runs


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: which run (warm start, commit, software and GPU) each arm came from."""
    lines = ["| run folder | warm start sha256 | commit | versions | arms |", "|---|---|---|---|---|"]
    for r in runs:
        v = r.get("versions")
        shown = ", ".join(f"{k} {x}" for k, x in v.items() if x) if v else "unknown"
        lines.append(f"| {r['folder']} | {(r['warm_start_sha256'] or 'unknown')[:16]} | "
                     f"{(r['commit'] or 'unknown')[:12]} | {shown} | {', '.join(r['arms'])} |")
    return "\n".join(lines)


# where a step's seconds go (r3bridge.demo.grpo's timing_s/*): weight sync to the engine, generation,
# compute_log_prob, the updates, the whole step
PHASES = ("update_weights", "gen", "old_log_prob", "update_actor", "step")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _after(arm: ArmLog, key: str, warmup: int) -> list[float]:
    return [v for s, v in arm.series(key) if s >= warmup]


def _ratio(a: float, b: float) -> float:
    """a / b; inf when only b is 0 (e.g. no token with |d| > ln 2 under R3), NaN when both are."""
    if math.isnan(a) or math.isnan(b) or (a == 0 and b == 0):
        return math.nan
    return math.inf if b == 0 else a / b


def _collapsed(arm: ArmLog) -> bool:
    """Reward of the last tenth below half its best 20-step mean, or any value not finite."""
    if any(not math.isfinite(v) for d in arm.data for v in d.values()):
        return True
    r = [v for _, v in arm.series("critic/score/mean")]
    if len(r) < 40:
        return False
    best = max(_mean(r[i:i + 20]) for i in range(len(r) - 19))
    return _mean(r[-max(1, len(r) // 10):]) < 0.5 * best


GRAD_MAX = "actor/grad_norm/max"


def _largest(arm: ArmLog) -> Optional[tuple[float, int]]:
    """The largest gradient norm of one update in the whole arm, warm-up included, and its step: a
    single spike the means hide (logs from before ``actor/grad_norm/max`` existed: the step's p99,
    short of the step's largest by 3 % of its gap to the second largest at 4 updates, 7 % at 8)."""
    series = arm.series(GRAD_MAX) or arm.series(P99)
    finite = [(v, s) for s, v in series if math.isfinite(v)]
    return max(finite) if finite else None


# the table's and the legend's order; other groups after
ORDER = ("off", "R2", "R3", "R3w", "floor", "R2-mb1", "R3-mb1", "R2-mb8", "R3-mb8")


def _ordered(groups: set[str]) -> list[str]:
    return sorted(groups, key=lambda g: (ORDER.index(g) if g in ORDER else len(ORDER), g))


def summarize(arms: list[ArmLog], warmup: int) -> dict[str, Any]:
    groups = _ordered({a.group for a in arms})
    by_group = {g: [a for a in arms if a.group == g] for g in groups}
    out: dict[str, Any] = {"warmup": warmup, "groups": {}, "ratios": {}, "off": {}}
    for g, members in by_group.items():
        out["groups"][g] = {"seeds": [a.seed for a in members], "steps": [len(a.steps) for a in members],
                            "collapsed": [a.name for a in members if _collapsed(a)],
                            "metrics": {key: {"per_seed": {a.name: _mean(_after(a, key, warmup)) for a in members}}
                                        for key, *_ in METRICS}}
        for key, *_ in METRICS:
            cell = out["groups"][g]["metrics"][key]
            cell["mean"] = _mean([v for v in cell["per_seed"].values() if not math.isnan(v)])
        out["groups"][g]["largest_grad_norm"] = {a.name: _largest(a) for a in members}
        out["groups"][g]["timing_s"] = {ph: _mean([v for a in members for v in _after(a, f"timing_s/{ph}", warmup)])
                                        for ph in PHASES}
    for num, den in PAIRS:
        if num not in by_group or den not in by_group:
            continue
        rows = {}
        for key, _, lower, _ in METRICS:
            per_seed = {}
            for a in by_group[num]:
                b = next((x for x in by_group[den] if x.seed == a.seed), None)
                if b is not None:
                    per_seed[a.seed] = _ratio(_mean(_after(a, key, warmup)), _mean(_after(b, key, warmup)))
            overall = _ratio(out["groups"][num]["metrics"][key]["mean"], out["groups"][den]["metrics"][key]["mean"])
            # "the ratio points the same way in each seed": the denominator's arm is better
            better = None if lower is None else [(r > 1) if lower else (r < 1) for r in per_seed.values()
                                                 if not math.isnan(r)]
            rows[key] = {"ratio": overall, "per_seed": per_seed,
                         "holds_across_seeds": None if better is None or not better else all(better)}
        out["ratios"][f"{num}/{den}"] = rows
    out["goals"] = _goals(out)
    if "off" in by_group:
        for key in ("actor/r3bridge/old_log_prob/mismatch/k3_kl", "actor/grad_norm/p99", "critic/score/mean"):
            drift = []
            for a in by_group["off"]:
                v = _after(a, key, warmup)
                q = max(1, len(v) // 4)
                drift.append(_ratio(_mean(v[-q:]), _mean(v[:q])) if v else math.nan)
            out["off"][key] = {"last_quarter_over_first": drift}
    return out


def _goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 49's goals, each with its measured value and met / not met (None: not measurable,
    e.g. an arm missing)."""
    goals = []
    off = summary["groups"].get("off")
    value = off["metrics"][AGREE]["mean"] if off else math.nan
    goals.append({"goal": f"off's route agreement <= {MAX_OFF_AGREEMENT}", "value": value,
                  "met": None if math.isnan(value) else value <= MAX_OFF_AGREEMENT})
    for label, (num, den), key, least in GOALS:
        r = summary["ratios"].get(f"{num}/{den}", {}).get(key, {}).get("ratio", math.nan)
        goals.append({"goal": label, "value": r, "met": None if math.isnan(r) else r >= least})
    return goals


def _fmt(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return {True: "yes", False: "no", None: "-"}[x]
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        if math.isinf(x):
            return "inf"
        return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)


MINI_BATCH_GROUPS = ("R2-mb1", "R3-mb1", "R2-mb8", "R3-mb8")


def _grid(summary: dict[str, Any], groups: list[str], pairs: list[str], head0: str) -> list[str]:
    head = [head0, *groups, *[f"{p} (every seed?)" for p in pairs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, *_ in METRICS:
        row = [label] + [_fmt(summary["groups"][g]["metrics"][key]["mean"]) for g in groups]
        for p in pairs:
            r = summary["ratios"][p][key]
            row.append(f"{_fmt(r['ratio'])} ({_fmt(r['holds_across_seeds'])})")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def table(summary: dict[str, Any]) -> str:
    """Markdown: per metric the mean after warm-up of each group, then off against each replay
    with whether every seed points the same way; where the 1 / 8 mini-batch arms ran, a second
    table of R2 against R3 at 1, 4 and 8 mini-batches; then off's drift, the collapse check and
    issue 49's goals, each met or not."""
    all_groups = list(summary["groups"])
    groups = [g for g in all_groups if g not in MINI_BATCH_GROUPS]
    pairs = [p for p in summary["ratios"] if not p.startswith("R2")]
    lines = _grid(summary, groups, pairs, "metric (mean after step %d)" % summary["warmup"])
    mb_groups = [g for g in ("R2-mb1", "R3-mb1", "R2", "R3", "R2-mb8", "R3-mb8") if g in all_groups]
    mb_pairs = [p for p in ("R2-mb1/R3-mb1", "R2/R3", "R2-mb8/R3-mb8") if p in summary["ratios"]]
    if any(g in all_groups for g in MINI_BATCH_GROUPS):
        lines += ["", "R2 against R3 at 1, 4 and 8 mini-batches per rollout batch (R2, R3: 4; ratio < 1 where "
                  "lower is better: R2 better):", ""]
        lines += _grid(summary, mb_groups, mb_pairs, "metric (mean after step %d)" % summary["warmup"])
    lines.append("")
    steps = ", ".join(f"{g}: {summary['groups'][g]['steps']}" for g in all_groups)
    lines.append(f"Steps per arm: {steps}.")
    lines += ["", "Where a step's seconds go (mean after warm-up, s: weight sync, generation, compute_log_prob, "
              "updates, whole step):", "", "| group | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for g in all_groups:
        t = summary["groups"][g].get("timing_s", {})
        lines.append(f"| {g} | " + " | ".join(_fmt(t.get(ph, math.nan)) for ph in PHASES) + " |")
    largest = [f"{n} {_fmt(v[0])} ({v[1]})" for g in all_groups
               for n, v in summary["groups"][g]["largest_grad_norm"].items() if v]
    lines += ["", "Largest gradient norm of one update, before clipping, per arm (step): " + ", ".join(largest) + "."]
    lines.append("")
    for key, d in summary["off"].items():
        lines.append(f"off, {key}: last quarter / first quarter after warm-up = "
                     + ", ".join(_fmt(x) for x in d["last_quarter_over_first"]) + " (per seed).")
    collapsed = [n for g in all_groups for n in summary["groups"][g]["collapsed"]]
    lines.append("Collapsed (reward of the last tenth < half its best 20-step mean, or a value not finite): "
                 + (", ".join(collapsed) if collapsed else "none") + ".")
    lines += ["", "Goals (issue 49, means after warm-up):", ""]
    for g in summary.get("goals", []):
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        lines.append(f"- {g['goal']}: {_fmt(g['value'])} - **{verdict}**")
    return "\n".join(lines)


def progress(run_dir: str | Path, now: Optional[float] = None, *, window: int = 10) -> list[dict[str, Any]]:
    """A running run's arms, read while they write (a line being written is skipped): per arm its
    steps, route agreement over its last 20 steps (issue 49's stop rule: off above 0.95 by step
    ~60), and its pace, the mean of its last ``window`` steps' seconds, with the steps it will
    have when the run's wall (run.json's deadline) comes: whatever else shares the GPU slows it."""
    root = Path(run_dir)
    info = _run_json(root) or {}
    target, deadline = info.get("grpo", {}).get("steps"), info.get("deadline")
    now = time.time() if now is None else now
    logs = root / "logs" if (root / "logs").is_dir() else root
    out = []
    for f in sorted(logs.glob("*.jsonl")):
        rows = [line["data"] for line in _log_lines(f, while_written=True) if "data" in line]
        arm: dict[str, Any] = {"arm": f.stem, "steps": len(rows), "target": target, "agreement": None,
                               "step_s": None, "steps_by_wall": None}
        agree = [r[AGREE] for r in rows[-20:] if AGREE in r]
        if agree:
            arm["agreement"] = _mean(agree)
        pace = [r["timing_s/step"] for r in rows[-window:] if "timing_s/step" in r]
        if pace:
            arm["step_s"] = _mean(pace)
            if deadline is not None:
                arm["steps_by_wall"] = len(rows) + int(max(0.0, deadline - now) / arm["step_s"])
        out.append(arm)
    return out


def progress_lines(arms: list[dict[str, Any]]) -> list[str]:
    lines = []
    for a in arms:
        text = f"{a['arm']}: {a['steps']} steps"
        if a["agreement"] is not None:
            text += f", agreement (last 20) {a['agreement']:.4f}"
        if a["step_s"] is not None and a["target"] and a["steps"] < a["target"]:
            text += f", {a['step_s']:.2f} s a step"
            if a["steps_by_wall"] is not None:
                text += (": on pace" if a["steps_by_wall"] >= a["target"]
                         else f": SHORT, {a['steps_by_wall']} of {a['target']} steps by the wall")
        lines.append(text)
    return lines


def load_calibration(path: str | Path) -> Optional[dict[str, Any]]:
    """``calibration.json`` of a run folder (or next to its logs), if the run calibrated."""
    root = Path(path)
    for candidate in (root / "calibration.json", root.parent / "calibration.json"):
        if candidate.exists():
            return json.loads(candidate.read_text())
    return None


def calibration_table(calib: dict[str, Any]) -> str:
    """Markdown: one row per candidate (agreement overall and its worst layer, router margins in
    the warm start and in the trainer, warm-start accuracy and time, step time, estimated run),
    then the choice and its reason."""
    head = ["candidate", "route agreement", "worst layer", "margin median (warm start / trainer)",
            "margins < threshold (trainer)", "warm-start accuracy", "warm start s", "step s", "run s (est.)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in calib["candidates"]:
        lines.append("| " + " | ".join([
            f"`{r['name']}`", _fmt(r["agreement"]), _fmt(r["agreement_min_layer"]),
            f"{_fmt(r['warm_margin_median'])} / {_fmt(r['margin_median'])}", _fmt(r["margin_below"]),
            _fmt(r["accuracy"]), _fmt(r["warm_seconds"]), _fmt(r["step_s"]), _fmt(r.get("run_s_estimate")),
        ]) + " |" + ("" if r["ran"] else f" ({r['error'][:120]})"))
    lines += ["", f"Chosen: `{calib['chosen']}` - {calib['reason']}."]
    return "\n".join(lines)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def curves(arms: list[ArmLog], key: str, *, log: bool, window: int = 10) -> dict[str, dict[str, Any]]:
    """What a panel draws, per group: ``seeds`` {arm: (steps, values)} raw, and ``mean`` (steps,
    values): the mean over the group's arms at the steps all of them reached, as a ``window``-step
    running mean. On a log axis values are floored at MIN_POSITIVE (an exact 0 stays visible)."""
    out: dict[str, dict[str, Any]] = {}
    for g in _ordered({a.group for a in arms}):
        members = [a for a in arms if a.group == g]
        seeds, per_step = {}, {}
        for a in members:
            pts = [(x, max(y, MIN_POSITIVE) if log else y) for x, y in a.series(key)]
            if not pts:
                continue
            seeds[a.name] = tuple(zip(*pts))
            for x, y in pts:
                per_step.setdefault(x, []).append(y)
        if not per_step:
            continue
        full = max(len(v) for v in per_step.values())
        xs = sorted(x for x, v in per_step.items() if len(v) == full)
        out[g] = {"seeds": seeds, "mean": (xs, _smooth([_mean(per_step[x]) for x in xs], window)),
                  "members": len(members)}
    return out
