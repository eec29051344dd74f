#!/usr/bin/env python3
"""SkyRL's real Megatron training path with r3bridge on one or two GPUs, R3 and R2 (issue 23, item 1).

SkyRL's own ``MegatronModelWrapper.forward`` (compute_log_prob) and
``forward_backward_mini_batch`` (one update: SkyRL's policy loss + KL, megatron's DDP, SkyRL's
deferred ``finalize_model_grads``), fed by SkyRL 0.4's own route transport (per-sample
``RoutedExpertTrace``, ``PackedTensor`` routes, ``router_padding_mask``, its distinct padding
rows) through r3bridge's SkyRL adapter (``PolicyWorkerMixin``, the replaying wrapper, R2 write-back
with ``SkyRLCodec.write_recorded``). The code is ``testlab.skyrl_real`` (the CPU runner of
tests/adapters/test_skyrl_real.py, release-aware); this file only spawns it on a device.

Per mode, 2 steps (compute_log_prob, R2 write-back, an update in another sample order, an
optimizer step): every router call of every pass (no-grad forward, the update's first pass and its
full recompute) is checked against the routes that had to be replayed, sharded with
``r3bridge.shard`` for the THD packing SkyRL really used, and logged as dispatch records keyed by
(sample, token), which are compared with the same routes independently. Under R2 the update's
log-probs must equal compute_log_prob's (same weights, same routes).

  --device cuda (default): NCCL, one GPU per rank; --layout tp1 (default), tp2_sp or pp2_vpp2 (two
    ranks; every rank's router calls checked, the dispatch records merged over the ranks);
    --layer-spec te (default; TE attention on SkyRL's packed THD input, bf16) or local (MoE-only
    layers, fp32).
  --route-transport handles: the routes by reference (docs/route-handles.md, "SkyRL"); per mode
    ``route_files``: each step's route files while it trained and after its release (0).
  --device cpu: gloo with the CPU shim, local spec, whatever SkyRL comes first on the path: 0.3 as
    installed on the CPU machines, or 0.4.0 (PYTHONPATH=build/skyrl04 and megatron-core >= 0.17 first;
    SkyRL 0.4's wrapper then imports on Python 3.11), with testlab.skyrl04_env's stand-in for
    megatron.bridge.peft.utils when Megatron-Bridge cannot import (``megatron_bridge_stand_in``).

Output: one JSON line (also <out>/skyrl04_train.json): ``ok`` and, per mode,
``router_rows_mismatched`` (must be 0), ``router_rows_checked`` (> 0), ``dispatch_errors`` ([]),
``dispatch_compared`` (> 0), ``max_logprob_diff`` (R2: <= --logprob-tol), ``grad_norms``.
Exit status 0 iff ok.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

# --layout: the two-rank layouts of the CPU test (tests/adapters/test_skyrl_real.py: etp = tp) and
# of cross_framework.py
LAYOUTS = {"tp1": {}, "tp2_sp": {"tp": 2, "etp": 2}, "pp2_vpp2": {"pp": 2, "vpp": 2}}


def _cell(ctx: Any, layer_spec: str, steps: int, device: str, route_transport: str = "inline") -> dict:
    from testlab.device_runs import PERMUTE, skyrl_rollouts, skyrl_spec
    from testlab.skyrl04_env import apply
    from testlab.skyrl_real import StepSpec, run_steps

    # SkyRL 0.4.0 imports two helpers that no released Megatron-Bridge has (testlab.skyrl04_env):
    # the stand-in goes in wherever megatron.bridge is not importable, CPU or GPU, and is reported
    stand_ins = apply()
    spec, rollouts = skyrl_spec(layer_spec), skyrl_rollouts(steps)
    out: dict[str, Any] = {"megatron_bridge_stand_in": stand_ins}
    for mode in ("R3", "R2"):
        t0 = time.time()
        out[mode] = run_steps(
            ctx,
            spec,
            StepSpec(mode=mode, remove_microbatch_padding=True, permute=PERMUTE, micro_train_batch_size=2,
                     route_transport=route_transport),
            rollouts,
        )
        out[mode]["seconds"] = round(time.time() - t0, 2)
    return out


def summarize(per_rank: list, steps: int, logprob_tol: float) -> dict:
    """Per mode, over every rank: the runner's router-call check and the dispatch records (merged
    over the ranks: each rank logs the rows and layers it routed) against the replayed routes."""
    from r3bridge.batch.schema import ReplayBatch
    from testlab.device_runs import dispatch_disagreements, skyrl_rollouts
    from testlab.dispatch_records import DispatchRecords

    rollouts = skyrl_rollouts(steps)
    modes, ok = {}, True
    for mode in ("R3", "R2"):
        ranks = [res[mode] for res in per_rank]
        recs = DispatchRecords.merge([r["dispatch"] for r in ranks])
        m: dict[str, Any] = {
            "router_rows_mismatched": 0,
            "router_rows_checked": 0,
            "errors": [],
            "dispatch_errors": [],
            "dispatch_compared": 0,
            "max_logprob_diff": [],
            "grad_norms": [],
            "seconds": max(r["seconds"] for r in ranks),
        }
        for rank, r in enumerate(ranks):
            for s in r["steps"]:
                m["router_rows_mismatched"] += s["fwd_mismatched"] + s["upd_mismatched"]
                m["router_rows_checked"] += s["fwd_checked"] + s["upd_checked"]
                m["errors"] += [f"rank {rank} step {s['step']}: {e}" for e in s["fwd_errors"] + s["upd_errors"]][:5]
        for s in ranks[0]["steps"]:
            i = s["step"]
            # the update's log-probs exist on the last pipeline stage only
            m["max_logprob_diff"].append(max((x["steps"][i].get("max_logprob_diff") for x in ranks
                                              if "max_logprob_diff" in x["steps"][i]), default=None))
            m["grad_norms"].append(s["grad_norm"])
            want = rollouts[i].expected() if mode == "R3" else ReplayBatch.from_bytes(s["recorded"])
            errs, n = dispatch_disagreements(
                recs.where(step=i), want, [len(t) for t in rollouts[i].tokens], f"skyrl {mode}"
            )
            m["dispatch_errors"] += errs[:5]
            m["dispatch_compared"] += n
        if "stored_files" in ranks[0]["steps"][0]:     # route_transport=handles: written per step, released after it
            m["route_files"] = [[s["stored_files"], s["files_after_release"]] for s in ranks[0]["steps"]]
        m["coverage_update"] = ranks[-1]["steps"][-1]["upd_metrics"].get("r3bridge/coverage")
        m["agreement_update"] = ranks[-1]["steps"][-1]["upd_metrics"].get("r3bridge/agreement/mean")
        mode_ok = (
            m["router_rows_mismatched"] == 0
            and m["router_rows_checked"] > 0
            and not m["errors"]
            and not m["dispatch_errors"]
            and m["dispatch_compared"] > 0
        )
        m["routes_ok"] = mode_ok
        if mode == "R2":  # same weights, same routes: the update's log-probs are compute_log_prob's
            m["logprob_ok"] = all(d is not None and d <= logprob_tol for d in m["max_logprob_diff"])
            mode_ok = mode_ok and m["logprob_ok"]
        m["ok"] = mode_ok
        ok = ok and mode_ok
        modes[mode] = m
    return {"ok": ok, "modes": modes, "megatron_bridge_stand_in": per_rank[0]["megatron_bridge_stand_in"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layer-spec", default=None, choices=["te", "local"], help="default: te on cuda, local on cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--logprob-tol", type=float, default=1e-5, help="R2: max |update log-prob - compute_log_prob log-prob|"
    )
    ap.add_argument("--layout", default="tp1", choices=sorted(LAYOUTS),
                    help="tp1 (1 GPU), tp2_sp or pp2_vpp2 (2 ranks: TP2 + SP, or PP2 x VPP2 with SkyRL's p2p settings)")
    ap.add_argument("--route-transport", default="inline", choices=["inline", "handles"],
                    help="handles: each step's routes written once (route_store: the default folder /dev/shm/r3bridge-routes), "
                         "each rank reads its rows of its stage's layers (docs/route-handles.md)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    layer_spec = a.layer_spec or ("te" if a.device == "cuda" else "local")

    import importlib.metadata as md

    from r3bridge.adapters.skyrl import SKYRL_RELEASE
    from r3bridge.testing.harness.dist import Layout, spawn_layouts
    from testlab.device_runs import backend_of, emit, error_text

    head = {
        "framework": "skyrl",
        "skyrl": md.version("skyrl"),
        "release": SKYRL_RELEASE,
        "megatron_core": md.version("megatron-core"),
        "device": a.device,
        "layer_spec": layer_spec,
        "layout": a.layout,
        "route_transport": a.route_transport,
    }
    if a.device == "cuda":
        import torch

        head["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.time()
    try:
        layout = Layout(**LAYOUTS[a.layout])
        (per_rank,) = spawn_layouts(
            _cell,
            world_size=layout.tp * layout.pp,
            layouts=[layout],
            args=(layer_spec, a.steps, a.device, a.route_transport),
            backend=backend_of(a.device),
            timeout=a.timeout,
        )
        summary = {**head, **summarize(per_rank, a.steps, a.logprob_tol)}
    except Exception as e:  # a failed rank: its traceback is the result
        summary = {**head, "ok": False, "error": error_text(e)}
    summary["seconds"] = round(time.time() - t0, 1)
    emit(a.out, "skyrl04_train", summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
