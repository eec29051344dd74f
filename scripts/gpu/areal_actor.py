#!/usr/bin/env python3
"""AReaL 1.0.4's real ``MegatronPPOActor`` with r3bridge on one GPU, R3 and R2 (issue 23, item 3).

AReaL's own actor (with r3bridge's ``MegatronEngineMixin`` / ``PPOActorMixin``) runs 2 PPO steps
per mode: ``compute_logp`` -> ``compute_advantages`` -> ``ppo_update`` (AReaL's GRPO loss,
megatron's optimizer over DDP chunks, full recompute), its tiny Qwen3-MoE built through mbridge as
AReaL builds it. Rollout side: r3bridge's SGLang-format routes (``meta_info``), decoded by AReaL's
own ``SGLangBackend`` and ``WorkflowMixin`` (``testlab.areal_rollout``). Every router call of every
pass (forward, update, recompute) is checked against the routes that had to be replayed (the
rollout's under R3, those recorded in that step's compute_logp under R2), sharded for AReaL's own
padded ``cu_seqlens``, and logged as dispatch records keyed by (sample, token), compared with the
same routes independently. The code is ``testlab.areal_runner`` (the CPU runner of
tests/adapters/test_areal_real.py); this file only spawns it on a device.

  --device cuda (default): NCCL, one GPU, TP1, the model on the GPU (mbridge's ``.cuda()``),
    megatron's optimizer without the CPU proxy. Layer spec: megatron's local spec with MoE-only
    layers (``testlab.mbridge_spec``'s TE-free bridge: AReaL packs THD, which local attention
    refuses), fp32 (AReaL's harness dtype).
  --device cpu: gloo with the CPU shim (what `make test` runs), for a smoke test here.

Output: one JSON line (also <out>/areal_actor.json): ``ok`` and, per mode,
``router_rows_mismatched`` (0), ``router_rows_checked`` (> 0), ``errors`` ([]),
``dispatch_errors`` ([]), ``dispatch_compared`` (> 0), ``calls`` per pass, ``grad_norms``.
Exit status 0 iff ok.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def _cell(ctx: Any, workdir: str, device: str, steps: int) -> dict:
    from testlab.areal_runner import run_steps
    from testlab.device_runs import areal_rollout

    out = {}
    for mode in ("R3", "R2"):
        t0 = time.time()
        res = run_steps(
            ctx,
            mode,
            areal_rollout(),
            f"{workdir}/{mode}/rank{ctx.rank}",
            steps=steps,
            n_mbs=2,
            ppo_n_minibatches=2,
            device=device,
        )
        res["mismatched"] = sum(r["mismatched"] for r in res.pop("records"))
        res["seconds"] = round(time.time() - t0, 2)
        out[mode] = res
    return out


def summarize(res: dict, steps: int) -> dict:
    from r3bridge.schema import ReplayBatch
    from testlab.device_runs import areal_rollout, dispatch_disagreements
    from testlab.dispatch_records import DispatchRecords

    rollout = areal_rollout()
    lens = [len(t) for t in rollout.tokens]
    modes, ok = {}, True
    for mode, r in res.items():
        recs = DispatchRecords.merge([r["dispatch"]])
        m: dict[str, Any] = {
            "router_rows_mismatched": r["mismatched"],
            "router_rows_checked": r["checked_rows"],
            "errors": r["errors"][:5],
            "calls": r["calls"],
            "grad_norms": r["grad_norms"],
            "dispatch_errors": [],
            "dispatch_compared": 0,
            "seconds": r["seconds"],
            "metrics_last_step": r["metrics"][-1] if r["metrics"] else {},
        }
        for step in range(steps):
            want = rollout.expected() if mode == "R3" else ReplayBatch.from_bytes(r["recorded"][step])
            errs, n = dispatch_disagreements(recs.where(step=step), want, lens, f"areal {mode}")
            m["dispatch_errors"] += errs[:5]
            m["dispatch_compared"] += n
        m["ok"] = (
            not r["errors"]
            and m["router_rows_mismatched"] == 0
            and m["router_rows_checked"] > 0
            and not m["dispatch_errors"]
            and m["dispatch_compared"] > 0
            and r["calls"].get("update/recompute", 0) > 0
        )
        ok = ok and m["ok"]
        modes[mode] = m
    return {"ok": ok, "modes": modes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()

    import importlib.metadata as md

    from r3bridge.testing.dist import Layout, spawn_layouts
    from testlab.device_runs import backend_of, emit, error_text

    head = {
        "framework": "areal",
        "areal": md.version("areal"),
        "mbridge": md.version("mbridge"),
        "megatron_core": md.version("megatron-core"),
        "device": a.device,
        "layer_spec": "local (MoE-only)",
        "layout": "tp1",
    }
    if a.device == "cuda":
        import torch

        head["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="areal-actor-") as workdir:
            (per_rank,) = spawn_layouts(
                _cell,
                world_size=1,
                layouts=[Layout()],
                args=(workdir, a.device, a.steps),
                backend=backend_of(a.device),
                timeout=a.timeout,
            )
        summary = {**head, **summarize(per_rank[0], a.steps)}
    except Exception as e:  # a failed rank: its traceback is the result
        summary = {**head, "ok": False, "error": error_text(e)}
    summary["seconds"] = round(time.time() - t0, 1)
    emit(a.out, "areal_actor", summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
