"""``r3bridge demo``: routing replay in a tiny RL loop, off vs R2 vs R3.

The rollout engine is HuggingFace transformers (a tiny Qwen3-MoE sampling with ``generate()``,
routes reported as vLLM / SGLang report them, weights lagging the trainer); the trainer is the same
model converted to megatron-core. One gloo process per rank on CPU (``--tp/--pp/--vpp/--ep/--cp``);
the rank work is in :mod:`r3bridge.demo.job`. Prints a table (or, with ``--json``, exactly
one JSON object: ``{"<mode>": {"route_agreement", "k3_kl", "abs_diff", "F2", "F5",
"replay_coverage"}}``) and writes a PNG (per-step agreement and k3 KL, per-layer agreement) when
matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from r3bridge.cli._common import CliError, installed, pyplot, require, save_figure

NAME = "demo"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="run off / R2 / R3 on a tiny real Megatron MoE model and compare",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["off", "R2", "R3", "all"], default="all")
    for name in ("tp", "pp", "ep", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--steps", type=int, default=4, help="RL steps (each: rollout, log-prob pass, mini-batch updates)")
    p.add_argument("--lag", type=int, default=1, help="the rollout engine holds the trainer's weights of LAG steps ago")
    p.add_argument("--engine-dtype", choices=["auto", "bf16", "bf16-weights", "fp32"], default="auto",
                   help="engine numerics; auto: bf16 on cuda, bf16-rounded weights with fp32 compute on cpu")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: one gloo process per rank; cuda: one process per GPU (NCCL)")
    p.add_argument("--spec", choices=["local", "te"], default="local",
                   help="trainer layer spec: local (megatron-core's torch modules, fp32) or te (Transformer "
                        "Engine: TE attention on packed THD input, TEGroupedMLP, bf16; needs --device cuda "
                        "and transformer-engine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate of the updates (default 0.003)")
    p.add_argument("--plot", default="r3bridge_demo.png",
                   help="PNG path ('' to skip; skipped with a note when matplotlib is not installed)")
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
        native = [r[mode]["agreement_mean"] for r in results if r[mode].get("agreement_mean") is not None]
        out[mode] = {
            "route_agreement": float(agree.sum() / total.sum()) if float(total.sum()) else 0.0,
            "k3_kl": mm["mismatch/k3_kl"], "abs_diff": mm["mismatch/abs_diff"],
            "F2": mm["mismatch/F2"], "F5": mm["mismatch/F5"],
            "replay_coverage": sum(cov) / len(cov),
            "_layers": per_layer,
            # the driver's own metric, as a training job logs it (r3bridge/update/agreement/mean): how
            # often the trainer's router alone would have picked the replayed set (None without
            # replay); not part of the JSON contract
            "_agreement_mean": sum(native) / len(native) if native else None,
            "_steps": _per_step(results, mode),
        }
    return out


def _per_step(results: list[dict[str, Any]], mode: str) -> list[dict[str, float]]:
    """Per RL step: agreement over all ranks' rows, k3 / |d| from the rank holding log-probs."""
    import torch

    from r3bridge.metrics import mismatch_from_sums

    steps = []
    for i in range(len(results[0][mode]["steps"])):
        agree = sum(r[mode]["steps"][i]["agree"] for r in results)
        total = sum(r[mode]["steps"][i]["total"] for r in results)
        sums = next(r[mode]["steps"][i]["sums"] for r in results if r[mode]["steps"][i]["sums"] is not None)
        mm = mismatch_from_sums(torch.tensor(sums, dtype=torch.float64), prefix="")
        steps.append({"route_agreement": agree / total if total else 0.0, "k3_kl": mm["mismatch/k3_kl"],
                      "abs_diff": mm["mismatch/abs_diff"]})
    return steps


def _plot(summary: dict[str, dict[str, Any]], path: str) -> None:
    plt = pyplot()
    modes = list(summary)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for m in modes:
        st = summary[m]["_steps"]
        xs = list(range(1, len(st) + 1))
        a.plot(xs, [s["route_agreement"] for s in st], marker="o", label=m)
        b.plot(xs, [max(s["k3_kl"], 1e-12) for s in st], marker="o", label=m)
    steps = range(1, max(len(summary[m]["_steps"]) for m in modes) + 1)
    a.set_xticks(list(steps))
    b.set_xticks(list(steps))
    a.set_xlabel("RL step")
    a.set_ylabel("route agreement (trainer vs reference)")
    a.legend(loc="lower left")
    b.set_xlabel("RL step")
    b.set_yscale("log")
    b.set_ylabel("k3 KL, train vs rollout log-probs")
    b.legend()
    layers = sorted({l for m in modes for l in summary[m]["_layers"]})
    w = 0.8 / max(len(modes), 1)
    for j, m in enumerate(modes):
        c.bar([x + j * w for x in range(len(layers))], [summary[m]["_layers"].get(l, 0) for l in layers], w, label=m)
    c.set_xticks([x + w * (len(modes) - 1) / 2 for x in range(len(layers))], [f"layer {l}" for l in layers])
    c.set_ylabel("route agreement per MoE layer")
    lo = min([summary[m]["_layers"].get(l, 1) for m in modes for l in layers] + [1.0])
    c.set_ylim(max(0.0, lo - 0.05), 1.005)
    c.legend(loc="lower left")
    fig.suptitle("r3bridge demo: HF transformers rollout engine (lagging weights) vs megatron-core trainer")
    fig.tight_layout()
    save_figure(fig, path)


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    # before anything imports them or a rank is spawned: one line naming what to install
    require("r3bridge demo", "demo", {"megatron.core": "megatron-core", "transformers": "transformers"})
    if args.spec == "te":
        if args.device != "cuda":
            raise CliError("--spec te needs --device cuda (Transformer Engine builds its modules on the GPU)")
        if not installed("transformer_engine"):
            raise CliError("--spec te needs transformer-engine (NVIDIA Transformer Engine with its PyTorch "
                           'extension), not installed: pip install "transformer-engine[pytorch]" '
                           "(or run --spec local)")
    from r3bridge.demo.job import DemoOptions, layout_problem, run_demo
    from r3bridge.testing.harness.dist import spawn

    problem = layout_problem(args.tp, args.pp, args.vpp, args.ep, args.cp, args.steps,
                             DemoOptions(layer_spec=args.spec))
    if args.lag < 0:
        problem = problem or f"--lag must be >= 0, got {args.lag}"
    if problem:
        raise CliError(problem)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    plot = args.plot
    if plot and not _have_matplotlib():
        # the numbers do not need matplotlib: say so and run without the figure
        print("[r3bridge demo] matplotlib is not installed: the plot is skipped "
              "(pip install 'r3bridge[plot]')", file=sys.stderr, flush=True)
        plot = ""
    modes = ["off", "R2", "R3"] if args.mode == "all" else [args.mode]
    world = max(args.tp * args.cp * args.pp, args.ep * args.pp)
    opts = DemoOptions(modes=tuple(modes), steps=args.steps, seed=args.seed, verbose=not args.json,
                       device=args.device, lag=args.lag, engine_dtype=args.engine_dtype, layer_spec=args.spec,
                       **({} if args.lr is None else {"lr": args.lr}))
    log(f"[r3bridge demo] {world} {args.device.upper()} rank(s): tp={args.tp} pp={args.pp} vpp={args.vpp} ep={args.ep} "
        f"cp={args.cp}; {args.spec} layer spec; modes {', '.join(modes)}; {args.steps} step(s); rollout engine: HF transformers "
        f"Qwen3-MoE ({'bf16' if args.device == 'cuda' and args.engine_dtype == 'auto' else args.engine_dtype}), "
        f"weights {args.lag} step(s) behind the trainer")
    t0 = time.time()
    results = spawn(run_demo, world_size=world, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                    args=(opts,), timeout=1800, backend="nccl" if args.device == "cuda" else "gloo")
    summary = summarize(results, modes)
    public = {m: {k: v for k, v in s.items() if not k.startswith("_")} for m, s in summary.items()}
    if args.json:
        print(json.dumps(public, allow_nan=False))
    else:
        print(f"{'mode':<5} {'route_agreement':>15} {'agreement/mean':>14} {'k3_kl':>10} {'|d|':>10} {'F(2)':>9} "
              f"{'F(5)':>9} {'coverage':>9}")
        for m, s in public.items():
            nat = summary[m]["_agreement_mean"]
            print(f"{m:<5} {s['route_agreement']:>15.4f} {'-' if nat is None else f'{nat:.4f}':>14} "
                  f"{s['k3_kl']:>10.3e} {s['abs_diff']:>10.3e} {s['F2']:>9.2e} {s['F5']:>9.2e} "
                  f"{s['replay_coverage']:>9.3f}")
        for m, s in summary.items():
            layers = " ".join(f"L{l}={v:.3f}" for l, v in s["_layers"].items())
            steps = " ".join(f"{x['route_agreement']:.3f}/{x['k3_kl']:.1e}" for x in s["_steps"])
            print(f"  {m} per-layer route_agreement: {layers}; per step (route_agreement/k3): {steps}")
    if plot:
        _plot(summary, plot)
        log(f"plot: {plot}")
    log(f"[r3bridge demo] done in {time.time() - t0:.0f}s")
    return 0
