#!/usr/bin/env python3
"""One canonical rollout through the real training paths of several frameworks on GPUs: identical
dispatched routes (issue 23, item 4; the device run of tests/adapters/test_real_paths_agree.py).

Each framework runs its runner (``testlab.real_paths``: the CPU test's rank functions) on the same
rollout, R3, full recompute, one step (compute_log_prob and one update), in its own spawned set of
ranks; every router row is mapped back to (sample, token) with the packing that framework really
used; the records are merged over ranks and compared (``testlab.dispatch_records.compare_dispatch``:
the same passes, every token of every sample on every MoE layer, and on every routed row the same
sorted expert ids in every framework, equal to the rollout's).

Frameworks (``--frameworks``, default ``skyrl,areal``):
  skyrl  the installed SkyRL (0.4.0 on the device's Python 3.12; 0.3 on the CPU machines): its
         ``MegatronModelWrapper`` with SkyRL's THD packing; ``--skyrl-spec te`` (default on cuda: TE
         attention, bf16) or ``local`` (MoE-only layers, fp32).
  areal  AReaL 1.0.4's ``MegatronPPOActor`` (mbridge-built, local spec MoE-only layers, fp32).
  verl   verl 0.9.1's ``TrainingWorker``: its runner (``testlab.verl_job``) builds through the CPU
         harness shims (``testlab.verl_cpu``) and is run on ``--device cpu`` only here; on the GPU
         verl's own job is ``scripts/gpu/verl_e2e.sh``.
Layouts (``--layouts``): ``tp1`` (1 GPU, default) or ``tp2_sp,pp2_vpp2`` (2 ranks, as the CPU test).

Output: one JSON line (also <out>/cross_framework.json): ``ok``, per layout the comparison's
``errors`` ([]), ``compared`` routed entries (> 0), ``keys`` per framework (equal: 3 passes x
tokens x MoE layers), and per framework its own router-call check (``errors`` [], ``checked`` > 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

LAYOUTS = {"tp1": dict(), "tp2_sp": dict(tp=2), "pp2_vpp2": dict(pp=2, vpp=2)}


def _skyrl(ctx: Any, rollouts: list, layer_spec: str, device: str) -> dict:
    from testlab.real_paths import run_skyrl

    if device == "cpu":  # SkyRL 0.4 on a CPU machine: testlab.skyrl04_env's Megatron-Bridge stand-in
        from testlab.skyrl04_env import apply

        apply()

    return run_skyrl(ctx, rollouts, layer_spec)


def _areal(ctx: Any, workdir: str, rollout: Any, device: str, names: list) -> dict:
    from testlab.real_paths import run_areal

    return run_areal(ctx, f"{workdir}/{names[ctx.layout_index]}", rollout, device)


def _verl(ctx: Any, model_dir: str, rollout: Any) -> dict:
    from testlab.real_paths import run_verl

    return run_verl(ctx, model_dir, rollout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--frameworks", default="skyrl,areal")
    ap.add_argument("--layouts", default="tp1", help="tp1, or tp2_sp,pp2_vpp2 (2 ranks)")
    ap.add_argument("--skyrl-spec", default=None, choices=["te", "local"], help="default: te on cuda, local on cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()

    import importlib.metadata as md

    from r3bridge.testing.dist import Layout, spawn_layouts
    from testlab.device_runs import backend_of, emit
    from testlab.dispatch_records import DispatchRecords, compare_dispatch
    from testlab.real_paths import rollout as make

    fws = [f for f in a.frameworks.split(",") if f]
    names = [n for n in a.layouts.split(",") if n]
    bad = [f for f in fws if f not in ("skyrl", "areal", "verl")] + [n for n in names if n not in LAYOUTS]
    if bad or (a.device == "cuda" and "verl" in fws):
        ap.error(f"unknown or unsupported here: {bad or ['verl on cuda']}")
    world = 1 if names == ["tp1"] else 2
    if "tp1" in names and world != 1:
        ap.error("tp1 runs alone (1 rank); tp2_sp and pp2_vpp2 together (2 ranks)")
    skyrl_spec = a.skyrl_spec or ("te" if a.device == "cuda" else "local")
    versions = {}
    for dist in ("skyrl", "areal", "verl", "megatron-core", "mbridge"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    head = {"frameworks": fws, "layouts": names, "device": a.device, "skyrl_spec": skyrl_spec, "versions": versions}
    if a.device == "cuda":
        import torch

        head["gpu"] = torch.cuda.get_device_name(0)
    rollout = make()
    backend = backend_of(a.device)
    layouts = []
    for n in names:
        kw = dict(LAYOUTS[n])
        if kw.get("tp", 1) > 1:
            kw["etp"] = kw["tp"]  # megatron's default (test_skyrl_real.py)
        layouts.append(Layout(**kw))
    t0 = time.time()
    per_fw: dict[str, list] = {}
    summary: dict[str, Any] = dict(head)
    try:
        with tempfile.TemporaryDirectory(prefix="cross-framework-") as tmp:
            for fw in fws:
                if fw == "skyrl":
                    args: tuple = ([rollout], skyrl_spec if world == 1 or a.skyrl_spec else None, a.device)
                    fn: Any = _skyrl
                elif fw == "areal":
                    fn, args = _areal, (f"{tmp}/areal", rollout, a.device, names)
                else:
                    from testlab.verl_job import write_tiny_qwen3_moe

                    fn, args = _verl, (write_tiny_qwen3_moe(f"{tmp}/model"), rollout)
                per_fw[fw] = spawn_layouts(
                    fn, world_size=world, layouts=layouts, args=args, backend=backend, timeout=a.timeout
                )
        lens = [len(t) for t in rollout.tokens]
        ok, out = True, {}
        for i, n in enumerate(names):
            recs = {fw: DispatchRecords.merge([r["dispatch"] for r in per_fw[fw][i]]).where(step=0) for fw in fws}
            res = compare_dispatch(recs, rollout.expected(), lens)
            own = {
                fw: {
                    "errors": [e for r in per_fw[fw][i] for e in r["errors"]][:5],
                    "checked": sum(r["checked"] for r in per_fw[fw][i]),
                    "micro_batches": per_fw[fw][i][0]["micro_batches"],
                }
                for fw in fws
            }
            layout_ok = (
                not res.errors
                and res.compared > 0
                and len(set(res.keys.values())) == 1
                and all(not o["errors"] and o["checked"] > 0 for o in own.values())
            )
            out[n] = {
                "ok": layout_ok,
                "errors": res.errors[:10],
                "compared": res.compared,
                "keys": res.keys,
                "per_framework": own,
            }
            ok = ok and layout_ok
        summary.update(ok=ok, layouts_result=out)
    except Exception as e:  # a failed rank: its traceback is the result
        summary.update(ok=False, error=f"{type(e).__name__}: {e}"[-4000:])
    summary["seconds"] = round(time.time() - t0, 1)
    emit(a.out, "cross_framework", summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
