"""``r3bridge inspect FILE [--json] [--plot OUT.png]``: what a saved route set holds."""
from __future__ import annotations

import argparse
from pathlib import Path

from r3bridge.batch.provenance import route_label
from r3bridge.batch.schema import ReplayBatch
from r3bridge.cli._common import (
    fmt_ids,
    fmt_num,
    fmt_pct,
    load_batch,
    pyplot,
    report,
    save_figure,
    table,
)
from r3bridge.metrics import expert_load

NAME = "inspect"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME, help="summarise a saved route set (.r3b)",
        description="Summarise a saved ReplayBatch (the bytes of ReplayBatch.to_bytes(), e.g. a .r3b "
                    "file): shape, coverage, layers, provenance and the per-layer expert load over "
                    "valid rows.")
    p.add_argument("file", help="saved ReplayBatch (ReplayBatch.to_bytes() written to a file), or a trace "
                                "folder (the r3bridge option trace_dir)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--plot", metavar="OUT.png", help="write a layers x experts load heatmap (matplotlib); for a "
                                                     "trace: per-layer agreement per pass and the expert load")
    p.add_argument("--step", type=int, default=None, help="trace: only this RL step")
    p.add_argument("--lowest", type=int, default=5, help="trace: how many lowest-agreement samples per pass")
    return p


def summarize(batch: ReplayBatch, *, file: str | None = None, file_bytes: int | None = None) -> dict:
    """The JSON object ``inspect --json`` prints."""
    load = expert_load(batch).cpu()
    valid_rows = int(batch.valid.sum())
    mean = valid_rows * batch.topk / batch.num_experts
    per_layer = []
    for j, lid in enumerate(batch.layer_ids):
        c = load[j]
        mx = int(c.max()) if c.numel() else 0
        per_layer.append({
            "layer": lid,
            "min": int(c.min()) if c.numel() else 0,
            "max": mx,
            "mean": mean,
            "imbalance": mx / mean if mean else float("nan"),
            "unused_experts": int((c == 0).sum()),
            "counts": c.tolist(),
        })
    rps = batch.rows_per_seq
    return {
        "file": file,
        "bytes": file_bytes if file_bytes is not None else batch.nbytes,
        "source": route_label(batch.route_kind, batch.engine),
        "route_kind": batch.route_kind, "engine": batch.engine,
        "samples": batch.num_seqs,
        "tokens": batch.total_rows,
        "valid_tokens": valid_rows,
        "coverage": valid_rows / batch.total_rows if batch.total_rows else float("nan"),
        "shape": list(batch.routes.shape),
        "dtype": str(batch.routes.dtype).replace("torch.", ""),
        "layer_ids": list(batch.layer_ids),
        "num_experts": batch.num_experts,
        "topk": batch.topk,
        "tokens_per_sample": {"min": min(rps) if rps else 0, "max": max(rps) if rps else 0,
                         "mean": sum(rps) / len(rps) if rps else float("nan")},
        "start_rows": {"min": min(batch.start_rows) if rps else 0,
                       "max": max(batch.start_rows) if rps else 0},
        "policy_versions": (None if batch.policy_versions is None else
                            {"min": min(batch.policy_versions, default=0),
                             "max": max(batch.policy_versions, default=0)}),
        "expert_load": per_layer,
    }


def render(s: dict) -> str:
    lines = [f"r3bridge inspect: {s['file']}"]
    rps, st = s["tokens_per_sample"], s["start_rows"]
    kv = [
        ("bytes", f"{s['bytes']:,}"),
        ("source", s["source"]),
        ("samples", f"{s['samples']}  (tokens per sample: min {rps['min']}, mean "
                    f"{fmt_num(rps['mean'], 1)}, max {rps['max']}; start rows {st['min']}..{st['max']})"),
        ("tokens", f"{s['tokens']}  (valid {s['valid_tokens']}, coverage {fmt_pct(s['coverage'])})"),
        ("routes", f"{s['shape']} {s['dtype']}"),
        ("layers", f"{len(s['layer_ids'])}: {fmt_ids(s['layer_ids'])}"),
        ("experts", str(s["num_experts"])),
        ("topk", str(s["topk"])),
    ]
    if s["policy_versions"] is not None:
        pv = s["policy_versions"]
        kv.append(("policy", f"versions {pv['min']}..{pv['max']}"))
    w = max(len(k) for k, _ in kv)
    lines += [f"  {k.ljust(w)}  {v}" for k, v in kv]
    lines.append("")
    mean = s["expert_load"][0]["mean"] if s["expert_load"] else 0.0
    lines.append(f"expert load per layer (valid tokens x topk per expert; uniform = {fmt_num(mean, 1)}; "
                 f"imbalance = max / uniform)")
    lines.append(table(["layer", "min", "max", "imbalance", "unused"],
                       [[r["layer"], r["min"], r["max"], fmt_num(r["imbalance"]), r["unused_experts"]]
                        for r in s["expert_load"]]))
    return "\n".join(lines)


def plot(s: dict, out: str) -> None:
    plt = pyplot()
    import numpy as np
    data = np.array([r["counts"] for r in s["expert_load"]], dtype=float).reshape(
        len(s["layer_ids"]), s["num_experts"])
    L, E = data.shape
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.18 * E + 2), 20.0), min(max(3.0, 0.28 * L + 1.5), 14.0)))
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax, label="tokens routed (valid tokens)")
    if L <= 48:
        ax.set_yticks(range(L), [str(x) for x in s["layer_ids"]])
    ax.set_ylabel("layer id")
    ax.set_xlabel("expert")
    name = Path(s["file"]).name if s["file"] else "routes"
    ax.set_title(f"{name}: expert load ({s['valid_tokens']} valid tokens, top-{s['topk']}, source {s['source']})",
                 fontsize=9)
    save_figure(fig, out)


def run(args) -> int:
    if Path(args.file).is_dir():
        return _run_trace(args)
    batch, nbytes = load_batch(args.file)
    s = summarize(batch, file=args.file, file_bytes=nbytes)
    return report(args, s, render, plot)



def _run_trace(args) -> int:
    from r3bridge.cli import trace_view

    s = trace_view.summarize_trace(args.file, lowest=args.lowest, step=args.step)
    return report(args, s, trace_view.render_trace, trace_view.plot_trace)
