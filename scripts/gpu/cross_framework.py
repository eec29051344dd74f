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
``--path-<framework> DIRS``: run that framework in a child interpreter whose PYTHONPATH starts with
DIRS (its own wheel sets): SkyRL 0.4 needs megatron-core >= 0.17, while AReaL's mbridge 0.15.1 fails
on 0.17 (``mbridge/core/util.py:83``: ``ModelType.encoder_and_decoder`` is gone), so on the device
the two run with different megatron-core sites.

Output: one JSON line (also <out>/cross_framework.json): ``ok``, per layout the comparison's
``errors`` ([]), ``compared`` routed entries (> 0), ``keys`` per framework (equal: 3 passes x
tokens x MoE layers), and per framework its own router-call check (``errors`` [], ``checked`` > 0).
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

LAYOUTS = {"tp1": dict(), "tp2_sp": dict(tp=2), "pp2_vpp2": dict(pp=2, vpp=2)}


def _skyrl(ctx: Any, rollouts: list, layer_spec: str, device: str) -> dict:
    from testlab.real_paths import run_skyrl

    # SkyRL 0.4.0's two Megatron-Bridge helpers exist in no released Megatron-Bridge: the stand-in
    # (testlab.skyrl04_env) goes in wherever megatron.bridge is not importable, CPU or GPU
    from testlab.skyrl04_env import apply

    apply()

    return run_skyrl(ctx, rollouts, layer_spec)


def _areal(ctx: Any, workdir: str, rollout: Any, device: str, names: list) -> dict:
    from testlab.real_paths import run_areal

    return run_areal(ctx, f"{workdir}/{names[ctx.layout_index]}", rollout, device)


def _verl(ctx: Any, model_dir: str, rollout: Any) -> dict:
    from testlab.real_paths import run_verl

    return run_verl(ctx, model_dir, rollout)


def run_framework(fw: str, names: list, device: str, skyrl_spec: Optional[str], timeout: float) -> list:
    """``fw`` on the rollout under each layout of ``names``, in this process's environment:
    per-layout, per-rank results of its ``testlab.real_paths`` rank function."""
    from r3bridge.testing.harness.dist import Layout, spawn_layouts
    from testlab.device_runs import backend_of
    from testlab.real_paths import rollout as make

    rollout = make()
    world = 1 if names == ["tp1"] else 2
    layouts = []
    for n in names:
        kw = dict(LAYOUTS[n])
        if kw.get("tp", 1) > 1:
            kw["etp"] = kw["tp"]  # megatron's default (test_skyrl_real.py)
        layouts.append(Layout(**kw))
    with tempfile.TemporaryDirectory(prefix="cross-framework-") as tmp:
        if fw == "skyrl":
            args: tuple = ([rollout], skyrl_spec, device)
            fn: Any = _skyrl
        elif fw == "areal":
            fn, args = _areal, (f"{tmp}/areal", rollout, device, names)
        else:
            from testlab.verl_job import write_tiny_qwen3_moe

            fn, args = _verl, (write_tiny_qwen3_moe(f"{tmp}/model"), rollout)
        return spawn_layouts(
            fn, world_size=world, layouts=layouts, args=args, backend=backend_of(device), timeout=timeout
        )


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("skyrl", "areal", "verl", "megatron-core", "mbridge", "megatron-bridge"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def run_framework_in_child(
    fw: str, prefix: str, a: argparse.Namespace, names: list, skyrl_spec: Optional[str], tmp: str
) -> tuple[list, dict]:
    """``fw`` in a child interpreter whose PYTHONPATH starts with ``prefix`` (its own wheel sets:
    SkyRL 0.4 needs megatron-core >= 0.17, AReaL's mbridge 0.15.1 fails on 0.17's ModelType)."""
    out = os.path.join(tmp, f"{fw}.pkl")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (prefix, ROOT, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--device",
        a.device,
        "--layouts",
        ",".join(names),
        "--timeout",
        str(a.timeout),
        "--one",
        fw,
        "--one-out",
        out,
    ]
    if skyrl_spec:
        cmd += ["--skyrl-spec", skyrl_spec]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout + 120)
    if p.returncode != 0:
        raise RuntimeError(f"{fw} (PYTHONPATH prefix {prefix}) failed:\n{(p.stdout + p.stderr)[:8000]}\n[...]\n{(p.stdout + p.stderr)[-3000:]}")
    import torch

    from testlab.dispatch_records import DispatchRecords

    with open(out, "rb") as f:
        got = pickle.load(f)
    for per_rank in got["results"]:
        for r in per_rank:
            name, keys, ids = r["dispatch"]
            r["dispatch"] = (
                DispatchRecords(name, torch.tensor(keys, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64))
                if keys
                else DispatchRecords(name)
            )
    return got["results"], got["versions"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--frameworks", default="skyrl,areal")
    ap.add_argument("--layouts", default="tp1", help="tp1, or tp2_sp,pp2_vpp2 (2 ranks)")
    ap.add_argument("--skyrl-spec", default=None, choices=["te", "local"], help="default: te on cuda, local on cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--timeout", type=float, default=900)
    for fw in ("skyrl", "areal", "verl"):
        ap.add_argument(
            f"--path-{fw}",
            default="",
            help=f"PYTHONPATH prefix of a child process running {fw} "
            "(its own wheel sets); default: this process's environment",
        )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one framework, results pickled
    ap.add_argument("--one-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        names = [n for n in a.layouts.split(",") if n]
        res = run_framework(a.one, names, a.device, a.skyrl_spec, a.timeout)
        # plain Python data: the parent may import another megatron-core, whose pickle reducers differ
        plain = [
            [
                {**r, "dispatch": (r["dispatch"].framework, r["dispatch"].keys.tolist(), r["dispatch"].ids.tolist())}
                for r in per_rank
            ]
            for per_rank in res
        ]
        with open(a.one_out, "wb") as f:
            pickle.dump({"results": plain, "versions": _versions()}, f)
        return 0

    from testlab.device_runs import emit, error_text
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
    if world > 1 and not a.skyrl_spec:
        skyrl_spec = None  # the CPU test's choice per layout (testlab.real_paths.run_skyrl)
    head: dict[str, Any] = {
        "frameworks": fws,
        "layouts": names,
        "device": a.device,
        "skyrl_spec": skyrl_spec,
        "versions": {},
    }
    if a.device == "cuda":
        import torch

        head["gpu"] = torch.cuda.get_device_name(0)
    rollout = make()
    t0 = time.time()
    per_fw: dict[str, list] = {}
    summary: dict[str, Any] = dict(head)
    try:
        with tempfile.TemporaryDirectory(prefix="cross-framework-") as tmp:
            for fw in fws:
                prefix = getattr(a, f"path_{fw}")
                if prefix:
                    per_fw[fw], versions = run_framework_in_child(fw, prefix, a, names, skyrl_spec, tmp)
                else:
                    per_fw[fw], versions = run_framework(fw, names, a.device, skyrl_spec, a.timeout), _versions()
                summary["versions"][fw] = {
                    k: v for k, v in versions.items() if k in (fw, "megatron-core", "mbridge", "megatron-bridge")
                }
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
        summary.update(ok=False, error=error_text(e))
    summary["seconds"] = round(time.time() - t0, 1)
    emit(a.out, "cross_framework", summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
