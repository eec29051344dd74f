"""``r3bridge inspect TRACE_DIR`` / ``r3bridge diff TRACE_DIR [TRACE_DIR_B]``: route traces written
by a job with the ``trace_dir`` option (format and merging: :mod:`r3bridge.trace`).

A multi-rank trace is merged back into per-sample batches first, so it reads the same as a
one-rank trace. A damaged file is refused by the reader (:class:`r3bridge.trace.TraceError`,
naming the file; the CLI prints one line and exits 2)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from r3bridge.cli._common import CliError, fmt_ids, fmt_num, fmt_pct, pyplot, save_figure, table
from r3bridge.trace import MergedPass, Trace, TraceError, TracePass, compare, load_trace, pass_summary

# ===================================================================================== reading agreement
# Below this agreement of the trainer's own router with the rollout's routes, the two are not the
# same model. A model served by the engine it trains agrees on most (token, layer) pairs (0.95-0.98
# in the device runs of docs/gpu.md; a trained production model's near-ties lower it, but not to
# chance); chance is about top-k / experts.
DIFFERENT_MODELS_BELOW = 0.5


def models_note(agreement: float, *, route_kind: str = "rollout") -> Optional[str]:
    """What a low agreement between the trainer's own router and the replayed routes means, or None."""
    if not agreement == agreement or agreement >= DIFFERENT_MODELS_BELOW:    # nan: nothing compared
        return None
    if route_kind == "recorded":
        return (f"note: the update's router agrees with the routes it recorded in compute_log_prob on only "
                f"{fmt_pct(agreement)} of (token, layer) pairs: the weights moved far between the two passes (or the "
                f"router is untrained: nearly tied scores). Replay is unaffected: the update dispatched the recorded routes.")
    return (f"note: the trainer's router agrees with the engine's routes on only {fmt_pct(agreement)} of (token, layer) "
            f"pairs, so the engine and the trainer are different models: weights that were never synced (r3bridge's CPU "
            f"harness: by design), another checkpoint or architecture, or an untrained router (random initialisation "
            f"leaves the router scores nearly tied). Replay is unaffected (the routers dispatched the replayed routes; "
            f"coverage says on how many tokens); the log-prob mismatch will be large until the two are the same model.")


def _overall(passes: list[dict[str, Any]], route_kind: str) -> float:
    """Agreement over every replay pass of ``route_kind``, weighted by the pairs each compared."""
    agree = compared = 0
    for p in passes:
        if p.get("route_kind") == route_kind and p.get("action") == "replay":
            agree += sum(r.get("agree", 0) for r in p["per_layer"])
            compared += sum(r.get("compared", 0) for r in p["per_layer"])
    return agree / compared if compared else float("nan")


# ===================================================================================== inspect
def summarize_trace(path: str, *, lowest: int = 5, step: Optional[int] = None) -> dict[str, Any]:
    trace = load_trace(path)
    if not trace.passes and not trace.stops:
        raise CliError(f"{path}: the trace holds no pass")
    meta = trace.meta
    passes = [pass_summary(p, p.merge(), lowest=lowest) for p in trace.passes if step is None or p.step == step]
    if step is not None and not passes:
        raise CliError(f"{path}: no traced pass in step {step} (steps: {sorted({p.step for p in trace.passes})})")
    return {
        "trace": str(path), "framework": meta.get("framework"), "mode": meta.get("mode"),
        "ranks": trace.ranks, "layout": meta.get("layout"), "moe_layer_ids": meta.get("moe_layer_ids"),
        "num_experts": meta.get("num_experts"), "topk": meta.get("topk"),
        "stopped": [{k: s.get(k) for k in ("rank", "step", "pass", "pass_index", "bytes_written", "limit", "reason")}
                    for s in trace.stops],
        "passes": passes,
        "notes": [n for n in (models_note(_overall(passes, src), route_kind=src) for src in ("rollout", "recorded")) if n],
    }


def _logged(p: dict[str, Any], key: str) -> float:
    v = p["logged"].get(f"r3bridge/{key}")
    if v is None:                               # another metrics_prefix: the key's tail
        v = next((x for k, x in p["logged"].items() if k.endswith("/" + key)), float("nan"))
    return float("nan") if v is None else float(v)


def render_trace(s: dict[str, Any]) -> str:
    lay = s["layout"] or {}
    par = ", ".join(f"{k}={lay[k]}" for k in ("tp", "cp", "pp", "vpp", "ep") if lay.get(k) not in (None, 1))
    lines = [f"r3bridge inspect: {s['trace']}",
             f"  framework {s['framework']}, replay_mode {s['mode']}, {len(s['ranks'])} rank(s)"
             f"{' (' + par + ')' if par else ''}, MoE layers {fmt_ids(s['moe_layer_ids'] or [])}, "
             f"{s['num_experts']} experts, top-{s['topk']}"]
    if s["stopped"]:
        for st in s["stopped"]:
            lines.append(f"  stopped: rank {st['rank']} at step {st['step']} {st['pass']}.{st['pass_index']}: "
                         f"{st['reason']}")
    else:
        lines.append("  stopped: no (every pass of every traced step was written)")
    lines.append("")
    lines.append("per pass (agreement: the router's own top-k set equals the replayed one, over replayed tokens; "
                 "logged: what the driver reported)")
    rows = [[p["step"], p["pass"], p["action"], p["route_kind"] or "-", p["samples"], p["tokens"], fmt_pct(p["coverage"]),
             fmt_pct(p["agreement"]), fmt_pct(_logged(p, "agreement/mean")), _exact(p["handed"])] for p in s["passes"]]
    lines.append(table(["step", "pass", "action", "route kind", "samples", "tokens", "coverage", "agreement", "logged",
                        "dispatched != handed"], rows))
    lines.append(_exact_summary(s["passes"]))
    layers = s["moe_layer_ids"] or []
    lines.append("")
    lines.append("per-layer agreement")
    lines.append(table(["step", "pass", *[f"L{lid}" for lid in layers]],
                       [[p["step"], p["pass"], *[fmt_pct(r["agreement"]) for r in p["per_layer"]]]
                        for p in s["passes"]]))
    lines.append("")
    lines.append("expert load of the dispatched routes (imbalance = busiest expert / uniform; unused experts)")
    lines.append(table(["step", "pass", *[f"L{lid}" for lid in layers]],
                       [[p["step"], p["pass"], *[f"{fmt_num(r['imbalance'])}/{r['unused_experts']}"
                                                 for r in p["per_layer"]]] for p in s["passes"]]))
    lines.append("")
    lines.append("lowest agreement samples (sample id: agreement over its (token, layer) pairs)")
    for p in s["passes"]:
        if p["lowest_samples"]:
            low = ", ".join(f"{x['sample']}{'@dp' + str(x['dp_rank']) if x['dp_rank'] else ''}"
                            f"{' (' + x['uid'] + ')' if x.get('uid') else ''}: {fmt_pct(x['agreement'])}"
                            for x in p["lowest_samples"])
            lines.append(f"  step {p['step']} {p['pass']}: {low}")
    for note in s.get("notes", []):
        lines += ["", note]
    return "\n".join(lines)


def _exact(h: Optional[dict[str, Any]]) -> str:
    return "-" if h is None else f"{h['differing']} of {h['pairs']}"


def _exact_summary(passes: list[dict[str, Any]]) -> str:
    """One line: did the routers dispatch exactly the routes the framework handed over?"""
    checked = [p["handed"] for p in passes if p.get("handed") is not None]
    if not checked:
        return ("replay exactness: not checked (no pass kept the handed routes: a recording-only trace, or replay "
                "off)")
    pairs = sum(h["pairs"] for h in checked)
    bad = sum(h["differing"] for h in checked)
    verdict = "exact" if bad == 0 else "NOT EXACT"
    return (f"replay {verdict}: {bad} of {pairs} (token, layer) pairs with a handed route were dispatched otherwise, "
            f"over {len(checked)} pass(es) (handed: the routes the framework gave the trainer, the engine's for R3)")


def plot_trace(s: dict[str, Any], out: str) -> None:
    plt = pyplot()
    import numpy as np

    passes = s["passes"]
    if not passes:
        raise CliError(f"{s['trace']}: no pass was written (see 'stopped'): no plot")
    labels = [f"{p['step']}/{p['pass']}" for p in passes]
    layers = s["moe_layer_ids"] or []
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    x = np.arange(len(passes))
    for j, lid in enumerate(layers):
        ax0.plot(x, [p["per_layer"][j]["agreement"] for p in passes], marker="o", label=f"layer {lid}")
    ax0.plot(x, [_logged(p, "agreement/mean") for p in passes], color="black", linestyle="--", marker="x",
             label="logged agreement/mean")
    ax0.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax0.set_ylim(0, 1.05)
    ax0.set_ylabel("native top-k == replayed")
    ax0.set_title("agreement per layer and pass", fontsize=10)
    ax0.legend(fontsize=7, ncol=2)
    last = passes[-1]
    data = np.array([r["load"] for r in last["per_layer"]], dtype=float)
    im = ax1.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax1, label="tokens dispatched")
    ax1.set_yticks(range(len(layers)), [str(x) for x in layers])
    ax1.set_ylabel("layer id")
    ax1.set_xlabel("expert")
    ax1.set_title(f"expert load, step {last['step']} {last['pass']}", fontsize=10)
    fig.suptitle(f"{Path(s['trace']).name}: {s['framework']}, {s['mode']}, {len(s['ranks'])} rank(s)", fontsize=10)
    save_figure(fig, out)


# ===================================================================================== diff
def _select(trace: Trace, step: Optional[int], name: Optional[str]) -> list[TracePass]:
    out = []
    for p in trace.passes:
        if step is not None and p.step != step:
            continue
        if name is not None and name not in (p.label, p.name if p.index == 0 else None):
            continue
        out.append(p)
    if not out:
        raise CliError(f"{trace.root}: no traced pass matches step {step}, pass {name!r} (traced: "
                       f"{', '.join(f'{p.step}/{p.label}' for p in trace.passes)})")
    return out


def diff_traces(a: str, b: Optional[str], *, step: Optional[int], pass_a: Optional[str], pass_b: Optional[str],
                view_a: Optional[str], view_b: Optional[str], lowest: int = 5) -> dict[str, Any]:
    """Comparisons, each ``(step, pass, view)`` of A against ``(step, pass, view)`` of B:

    * one trace, no ``--vs-pass``: in every pass, the replayed routes against the router's own
      (rollout or recorded vs native);
    * one trace with ``--vs-pass``: the pass against another pass of the same step (default view
      native: how the router's choices moved between compute_log_prob and an update);
    * two traces: the same step and pass of both (default view dispatched)."""
    ta = load_trace(a)
    tb = ta if b is None else load_trace(b)
    if b is None and pass_b is None:
        va, vb = view_a or "replayed", view_b or "native"
    elif b is None:
        va, vb = view_a or "native", view_b or view_a or "native"
    else:
        va, vb = view_a or "dispatched", view_b or view_a or "dispatched"
    cache: dict[tuple[int, int, str], MergedPass] = {}

    def merged(t: Trace, p: TracePass) -> MergedPass:
        key = (id(t), p.step, p.label)
        if key not in cache:
            cache[key] = p.merge()
        return cache[key]

    comps = []
    for p in _select(ta, step, pass_a):
        if b is None and pass_b is None:
            if p.first["action"] != "replay":
                continue                        # a recording pass replays nothing
            q = p
        else:
            try:
                q = tb.find(p.step, pass_b or p.label)
            except TraceError:                  # not in B: skipped, and said so
                comps.append({"step": p.step, "pass_a": p.label, "pass_b": pass_b or p.label, "view_a": va,
                              "view_b": vb, "missing": "B"})
                continue
        c = compare(merged(ta, p), va, merged(tb, q), vb, lowest=lowest)
        comps.append({"step": p.step, "pass_a": p.label, "pass_b": q.label, "view_a": va, "view_b": vb,
                      "route_kind": p.first.get("route_kind"), **c})
    if not comps:
        raise CliError(f"{a}: no replay pass to compare (a recording-only trace: use --vs-pass or a second trace)")
    notes = []
    if b is None and pass_b is None:            # replayed vs native: the same reading as inspect's
        for src in ("rollout", "recorded"):
            done = [c for c in comps if not c.get("missing") and c.get("route_kind") == src]
            pairs = sum(c["tokens_compared"] * len(c["per_layer"]) for c in done)
            agree = sum(c["agreement"] * c["tokens_compared"] * len(c["per_layer"]) for c in done)
            note = models_note(agree / pairs if pairs else float("nan"), route_kind=src)
            if note:
                notes.append(note)
    return {"a": a, "b": b if b is not None else a, "comparisons": comps, "notes": notes}


def render_diff(s: dict[str, Any]) -> str:
    lines = [f"r3bridge diff: {s['a']}" + (f" vs {s['b']}" if s["b"] != s["a"] else "")]
    rows = []
    for c in s["comparisons"]:
        what = f"{c['pass_a']} {c['view_a']} vs {c['pass_b']} {c['view_b']}"
        if c.get("missing"):
            rows.append([c["step"], what, "-", "-", "-", f"not in {c['missing']}"])
            continue
        rows.append([c["step"], what, f"{c['samples']} (by {c.get('paired_by', 'sample id')})", c["tokens_compared"],
                     fmt_pct(c["agreement"]), fmt_pct(c["tokens_differing_any_layer"])])
    lines.append(table(["step", "compared", "samples (paired)", "tokens", "agreement", "tokens differing"], rows))
    done = [c for c in s["comparisons"] if not c.get("missing")]
    if done:
        layers = [r["layer"] for r in done[0]["per_layer"]]
        lines.append("")
        lines.append("per layer")
        lines.append(table(["step", "pass", *[f"L{lid}" for lid in layers]],
                           [[c["step"], c["pass_a"], *[fmt_pct(r["agreement"]) for r in c["per_layer"]]]
                            for c in done]))
        lines.append("")
        lines.append("lowest agreement samples")
        for c in done:
            if c["lowest_samples"]:
                lines.append(f"  step {c['step']} {c['pass_a']}: " + ", ".join(
                    f"{x['sample']}: {fmt_pct(x['agreement'])}" for x in c["lowest_samples"]))
    for note in s.get("notes", []):
        lines += ["", note]
    return "\n".join(lines)


def plot_diff(s: dict[str, Any], out: str) -> None:
    plt = pyplot()
    import numpy as np

    done = [c for c in s["comparisons"] if not c.get("missing")]
    if not done:
        raise CliError("nothing was compared: no plot")
    layers = [r["layer"] for r in done[0]["per_layer"]]
    data = np.array([[r["agreement"] if r["agreement"] is not None else np.nan for r in c["per_layer"]]
                     for c in done], dtype=float)
    fig, ax = plt.subplots(figsize=(min(max(5.0, 0.5 * len(layers) + 3), 16), max(2.5, 0.35 * len(done) + 1.5)))
    # a sequential scale, not red-to-green: agreement is how far the two routings are apart (for
    # rollout vs native: engine vs trainer), not whether replay worked, which it did on every row
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, label="top-k set agreement (not a pass / fail)")
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            if data.shape[0] * data.shape[1] <= 200:
                ax.text(j, i, fmt_pct(float(data[i, j])), ha="center", va="center", fontsize=7,
                        color="white" if data[i, j] < 0.5 else "black")      # readable on viridis's dark end
    ax.set_xticks(range(len(layers)), [str(x) for x in layers])
    ax.set_yticks(range(len(done)), [f"{c['step']}/{c['pass_a']}" for c in done], fontsize=8)
    ax.set_xlabel("layer id")
    c0 = done[0]
    title = f"{c0['view_a']} vs {c0['view_b']} per layer and pass"
    if s.get("notes"):
        title += "\nlow everywhere: the engine and the trainer are different models (see the text output)"
    ax.set_title(title, fontsize=10)
    save_figure(fig, out)
