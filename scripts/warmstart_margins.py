"""Warm-start calibration candidates on the CPU and print their router margins (issue 49).

The device calibration showed that a candidate's route agreement (vLLM bf16 against the bf16
megatron trainer) follows the warm-started router's margin median (k-th minus (k+1)-th logit), so
this script measures that margin, not a CPU stand-in for agreement. It runs the project's own warm
start (:func:`r3bridge.demo.warmstart.warm_start`: the same loss, schedule, 100-step accuracy checks
and stop at the target accuracy as the device's calibration) and its margin statistics (the
``router_margins`` the device calibration prints), one candidate after the other, and adds what the
stats do not hold: the router logits' mean and per-token std over experts (fp32, the same 256
problems as the margins) and the size of the fp32 state.pt a session would carry.

    OMP_NUM_THREADS=1 python scripts/warmstart_margins.py L6-E32-k8-aux1.0-z0.1 L6-E48-k8-aux0.4-z0.05 \
        --threads 1 --json /tmp/margins.json

Compare steps, not seconds: the device's 150 s warm-start budget buys 500-800 steps of an L6/L8
top-8 model with six candidates side by side (docs/gpu-results/h200_2026-11-29c); this CPU is far slower.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from r3bridge.demo import task as task_mod
from r3bridge.demo.evidence_config import parse_candidate
from r3bridge.demo.task import AdditionTask
from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions, router_margins, warm_start


@torch.no_grad()
def router_logit_moments(model: torch.nn.Module, task: AdditionTask, n: int, seed: int) -> dict:
    """Mean of the router logits and the mean per-token std over experts, over the real tokens of
    the same ``n`` problems :func:`router_margins` uses (its rng seed)."""
    ids, _ = task.sft_batch(n, np.random.default_rng(20_000 + seed))
    ids_t = torch.as_tensor(ids)
    out = model(input_ids=ids_t, output_router_logits=True)
    real = (ids_t != task_mod.PAD).reshape(-1)
    logits = torch.cat([r.float()[real] for r in out.router_logits])
    return {"mean": float(logits.mean()), "std_over_experts": float(logits.std(-1).mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("candidates", nargs="+", help="candidate specs, e.g. L6-E32-k8-aux1.0-z0.1")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="warm-start bound per candidate (CPU)")
    p.add_argument("--steps", type=int, default=None, help="warm-start steps at most (default: WarmStartOptions')")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="append one JSON line per candidate here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    task = AdditionTask()
    base_warm = WarmStartOptions(max_seconds=args.max_seconds,
                                 **({} if args.steps is None else {"steps": args.steps}))
    for spec in args.candidates:
        cand = parse_candidate(spec, EvidenceModelShape(), base_warm)
        opts = cand.warm(base_warm)
        t0 = time.time()
        state, stats = warm_start(cand.shape, task, opts, log=lambda s, spec=spec: print(f"[{spec}] {s}", flush=True))
        model = AutoModelForCausalLM.from_config(cand.shape.hf_config(), dtype=torch.float32)
        model.load_state_dict(state)
        model.eval()
        margins = router_margins(model, task, 256, opts.seed, "cpu")
        row = {"candidate": spec, "steps": stats["steps"], "accuracy": stats["greedy_accuracy"],
               "reached_target": stats["greedy_accuracy"] >= opts.target_accuracy,
               "curve": stats["curve"], "margin_median": margins["median"], "margin_below": margins["below"],
               "margin_per_layer": margins["per_layer"], "router_logits": router_logit_moments(model, task, 256, opts.seed),
               "state_mib": sum(v.numel() * 4 for v in state.values()) / 2**20,
               "seconds": time.time() - t0, "experts_implementation": stats["experts_implementation"]}
        print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "margin_per_layer")}), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
