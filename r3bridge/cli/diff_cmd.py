"""``r3bridge diff A B [--json] [--plot OUT.png]``: per-layer top-k agreement of two route sets."""
from __future__ import annotations

import argparse
from pathlib import Path

from r3bridge.batch.provenance import route_label
from r3bridge.cli._common import (
    CliError,
    fmt_ids,
    fmt_pct,
    load_batch,
    pyplot,
    report,
    save_figure,
    table,
)
from r3bridge.errors import ReplayError
from r3bridge.metrics import AgreementReport, route_agreement
from r3bridge.trace import VIEWS

NAME = "diff"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME, help="per-layer top-k agreement of two saved route sets",
        description="Compare two saved ReplayBatches of the same sequences (e.g. rollout routes vs "
                    "routes the trainer recorded). Rows are matched by token position and compared "
                    "where valid in both; top-k sets are compared order-insensitively, on the layers "
                    "both files hold.")
    p.add_argument("a", metavar="A", help="reference route file (e.g. rollout routes), or a trace folder")
    p.add_argument("b", metavar="B", nargs="?", default=None,
                   help="other route file (e.g. recorded routes); with a trace folder A: optional second trace")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--plot", metavar="OUT.png", help="write a per-layer agreement bar chart (matplotlib); for "
                                                     "traces: a passes x layers agreement heatmap")
    g = p.add_argument_group("traces (A a trace folder)")
    g.add_argument("--step", type=int, default=None, help="only this RL step")
    g.add_argument("--pass", dest="pass_a", default=None, metavar="PASS",
                   help="A's pass: compute_log_prob, update (= update.0), update.1, ...")
    g.add_argument("--vs-pass", dest="pass_b", default=None, metavar="PASS",
                   help="compare with this pass of the same step (default: the same pass)")
    g.add_argument("--view", dest="view_a", choices=VIEWS, default=None,
                   help="A's routes: replayed (rollout / recorded), native (the router's own top-k under "
                        "replay), dispatched (replayed where there was a route, else native) or handed (the "
                        "routes as the framework handed them over: `--view dispatched --vs-view handed` checks "
                        "that replay was exact)")
    g.add_argument("--vs-view", dest="view_b", choices=VIEWS, default=None,
                   help="B's routes (defaults: one pass: replayed vs native; two passes: native; two traces: "
                        "dispatched)")
    g.add_argument("--lowest", type=int, default=5, help="how many lowest-agreement samples per comparison")
    return p


def summarize(rep: AgreementReport, *, a: str, b: str, source_a: str, source_b: str) -> dict:
    """The JSON object ``diff --json`` prints."""
    return {
        "a": a, "b": b, "source_a": source_a, "source_b": source_b,
        "layer_ids": list(rep.layer_ids),
        "agreement": rep.mean,
        "tokens_differing_any_layer": rep.tokens_differing_any_layer,
        "tokens_compared": rep.rows_compared,
        "differing_tokens": rep.rows_differing_any_layer,
        "tokens_overlap": rep.rows_overlap,
        "tokens_valid_only_a": rep.rows_valid_only_reference,
        "tokens_valid_only_b": rep.rows_valid_only_other,
        "layers_only_a": list(rep.layers_only_reference),
        "layers_only_b": list(rep.layers_only_other),
        "per_layer": [{"layer": lid, "agreement": frac, "agree": ag,
                       "differing_tokens": rep.rows_compared - ag}
                      for (lid, frac), ag in zip(rep.per_layer.items(), rep.agree)],
    }


def render(s: dict) -> str:
    lines = [f"r3bridge diff: {s['a']} ({s['source_a']}) vs {s['b']} ({s['source_b']})"]
    kv = [
        ("tokens compared", f"{s['tokens_compared']}  (overlap {s['tokens_overlap']}; valid only in A: "
                            f"{s['tokens_valid_only_a']}, only in B: {s['tokens_valid_only_b']})"),
        ("layers", f"{len(s['layer_ids'])}: {fmt_ids(s['layer_ids'])}"),
    ]
    if s["layers_only_a"] or s["layers_only_b"]:
        kv.append(("not compared", f"layers only in A: {fmt_ids(s['layers_only_a'])}; "
                                   f"only in B: {fmt_ids(s['layers_only_b'])}"))
    kv += [
        ("agreement", f"{fmt_pct(s['agreement'])} of (token, layer) pairs have equal top-k sets"),
        ("tokens differing", f"{fmt_pct(s['tokens_differing_any_layer'])} of tokens differ in at least one "
                             f"layer ({s['differing_tokens']} of {s['tokens_compared']})"),
    ]
    w = max(len(k) for k, _ in kv)
    lines += [f"  {k.ljust(w)}  {v}" for k, v in kv]
    lines.append("")
    lines.append("per layer")
    lines.append(table(["layer", "agreement", "differing tokens"],
                       [[r["layer"], fmt_pct(r["agreement"]), r["differing_tokens"]] for r in s["per_layer"]]))
    return "\n".join(lines)


def plot(s: dict, out: str) -> None:
    plt = pyplot()
    ids = [r["layer"] for r in s["per_layer"]]
    vals = [r["agreement"] if r["agreement"] is not None and r["agreement"] == r["agreement"] else 0.0
            for r in s["per_layer"]]
    L = len(ids)
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.25 * L + 2), 20.0), 3.5))
    bars = ax.bar(range(L), vals, color="tab:blue")
    if L <= 24:
        ax.bar_label(bars, labels=[fmt_pct(v) for v in vals], fontsize=7, padding=2)
    if s["agreement"] == s["agreement"]:  # not NaN
        ax.axhline(s["agreement"], color="tab:red", linestyle="--", linewidth=1,
                   label=f"overall {fmt_pct(s['agreement'])}")
        ax.legend(loc="lower right", fontsize=8)
    if L <= 64:
        ax.set_xticks(range(L), [str(x) for x in ids], fontsize=7 if L > 24 else 9)
    ax.set_ylim(0.0, 1.08)
    ax.set_xlabel("layer id")
    ax.set_ylabel("top-k set agreement")
    ax.set_title(f"{Path(s['a']).name} vs {Path(s['b']).name}: {s['tokens_compared']} tokens compared, "
                 f"{fmt_pct(s['tokens_differing_any_layer'])} differ in some layer", fontsize=9)
    save_figure(fig, out)


def run(args) -> int:
    if Path(args.a).is_dir() or (args.b is not None and Path(args.b).is_dir()):
        return _run_trace(args)
    if args.b is None:
        raise CliError(f"{args.a}: diff needs two route files (or a trace folder)")
    a, _ = load_batch(args.a)
    b, _ = load_batch(args.b)
    try:
        rep = route_agreement(a, b)
    except ReplayError as e:
        raise CliError(f"{args.a} vs {args.b}: cannot compare: {e}") from None
    s = summarize(rep, a=args.a, b=args.b, source_a=route_label(a.route_kind, a.engine),
                  source_b=route_label(b.route_kind, b.engine))
    return report(args, s, render, plot)


def _run_trace(args) -> int:
    from r3bridge.cli import trace_view

    for x in (args.a, args.b):
        if x is not None and not Path(x).is_dir():
            raise CliError(f"{x}: not a trace folder (compare a trace with a trace, a route file with a route file)")
    s = trace_view.diff_traces(args.a, args.b, step=args.step, pass_a=args.pass_a, pass_b=args.pass_b,
                               view_a=args.view_a, view_b=args.view_b, lowest=args.lowest)
    return report(args, s, trace_view.render_diff, trace_view.plot_diff)
