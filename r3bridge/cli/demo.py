"""``r3bridge demo``: routing replay on a tiny real megatron-core MoE model, off vs R2 vs R3.

One gloo process per rank on CPU (``--tp/--pp/--vpp/--ep/--cp``); the rank work is in
:mod:`r3bridge.testing.demo_job`. Prints a table (or, with ``--json``, exactly one JSON object:
``{"<mode>": {"route_agreement", "k3_kl", "abs_diff", "F2", "F5", "replay_coverage"}}``) and
writes a PNG (per-layer agreement and mismatch per mode).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from r3bridge.cli._common import CliError, pyplot, save_figure

NAME = "demo"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="run off / R2 / R3 on a tiny real Megatron MoE model and compare",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["off", "R2", "R3", "all"], default="all")
    for name in ("tp", "pp", "ep", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--steps", type=int, default=2, help="RL steps (each: rollout, log-prob pass, mini-batch updates)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: one gloo process per rank; cuda: one process per GPU (NCCL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="r3bridge_demo.png", help="PNG path ('' to skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    return p


def summarize(results: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    """Per-rank results -> the contract's per-mode object (+ per-layer detail under '_layers')."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        agree = sum(torch.tensor(r[mode]["agree"]) for r in results)
        total = sum(torch.tensor(r[mode]["total"]) for r in results)
        mm = next(r[mode]["mismatch"] for r in results if r[mode]["mismatch"] is not None)
        cov = [r[mode]["coverage"] for r in results]
        per_layer = {int(i): float(agree[i] / total[i]) for i in range(len(total)) if total[i] > 0}
        native = [r[mode]["native_agreement"] for r in results if r[mode].get("native_agreement") is not None]
        out[mode] = {
            "route_agreement": float(agree.sum() / total.sum()) if float(total.sum()) else 0.0,
            "k3_kl": mm["mismatch/k3_kl"], "abs_diff": mm["mismatch/abs_diff"],
            "F2": mm["mismatch/F2"], "F5": mm["mismatch/F5"],
            "replay_coverage": sum(cov) / len(cov),
            "_layers": per_layer,
            # the driver's own metric: how often the trainer's router alone would have picked
            # the replayed set (None without replay); not part of the JSON contract
            "_native_agreement": sum(native) / len(native) if native else None,
        }
    return out


def _plot(summary: dict[str, dict[str, Any]], path: str) -> None:
    plt = pyplot()
    modes = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    layers = sorted({l for m in modes for l in summary[m]["_layers"]})
    w = 0.8 / max(len(modes), 1)
    for j, m in enumerate(modes):
        a.bar([x + j * w for x in range(len(layers))], [summary[m]["_layers"].get(l, 0) for l in layers], w, label=m)
    a.set_xticks([x + w * (len(modes) - 1) / 2 for x in range(len(layers))], [f"layer {l}" for l in layers])
    a.set_ylabel("route agreement (trainer vs reference)")
    a.set_ylim(0, 1.05)
    a.legend(loc="lower left")
    keys = ["k3_kl", "abs_diff", "F2"]
    for j, m in enumerate(modes):
        b.bar([x + j * w for x in range(len(keys))], [summary[m][k] for k in keys], w, label=m)
    b.set_xticks([x + w * (len(modes) - 1) / 2 for x in range(len(keys))], keys)
    b.set_yscale("log")
    b.set_ylabel("train vs rollout log-prob mismatch")
    b.legend()
    fig.suptitle("r3bridge demo: routing replay on a tiny megatron-core MoE model")
    fig.tight_layout()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from r3bridge.testing.demo_job import DemoOptions, layout_problem, run_demo
    from r3bridge.testing.dist import spawn

    problem = layout_problem(args.tp, args.pp, args.vpp, args.ep, args.cp, args.steps)
    if problem:
        raise CliError(problem)
    if args.plot:
        pyplot()    # fail before the run, not after it, when matplotlib is missing
    modes = ["off", "R2", "R3"] if args.mode == "all" else [args.mode]
    world = max(args.tp * args.cp * args.pp, args.ep * args.pp)
    opts = DemoOptions(modes=tuple(modes), steps=args.steps, seed=args.seed, verbose=not args.json,
                       device=args.device)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    log(f"[r3bridge demo] {world} {args.device.upper()} rank(s): tp={args.tp} pp={args.pp} vpp={args.vpp} ep={args.ep} "
        f"cp={args.cp}; modes {', '.join(modes)}; {args.steps} step(s)")
    t0 = time.time()
    results = spawn(run_demo, world_size=world, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                    args=(opts,), timeout=1800, backend="nccl" if args.device == "cuda" else "gloo")
    summary = summarize(results, modes)
    public = {m: {k: v for k, v in s.items() if not k.startswith("_")} for m, s in summary.items()}
    if args.json:
        print(json.dumps(public, allow_nan=False))
    else:
        print(f"{'mode':<5} {'agreement':>10} {'native':>8} {'k3_kl':>10} {'|d|':>10} {'F(2)':>9} {'F(5)':>9} "
              f"{'coverage':>9}")
        for m, s in public.items():
            nat = summary[m]["_native_agreement"]
            print(f"{m:<5} {s['route_agreement']:>10.4f} {'-' if nat is None else f'{nat:.4f}':>8} "
                  f"{s['k3_kl']:>10.3e} {s['abs_diff']:>10.3e} {s['F2']:>9.2e} {s['F5']:>9.2e} "
                  f"{s['replay_coverage']:>9.3f}")
        for m, s in summary.items():
            layers = " ".join(f"L{l}={v:.3f}" for l, v in s["_layers"].items())
            print(f"  {m} per-layer agreement: {layers}")
    if args.plot:
        _plot(summary, args.plot)
        log(f"plot: {args.plot}")
    log(f"[r3bridge demo] done in {time.time() - t0:.0f}s")
    return 0
