"""GPU conformance: representative cells of the CPU grid on NCCL, bf16, alltoall dispatcher.

    python scripts/gpu/nccl_conformance.py [--gpus 2] [--cells tp2_sp,pp2_1f1b,...] [--json OUT]

One process per GPU. Each cell runs tests/megatron/replay_grid.py's run_cell (R3 forward-only then
training step checked router call by router call against an independent packing reference, R2
record + replay with bit-identical logits, no state left) on CUDA with NCCL. The TP=PP=CP=1
comparison of the CPU grid is skipped: bf16 kernels differ across layouts.
Megatron-core 0.16.1 has no Transformer Engine here: only ``moe_utils.te_general_gemm = None`` is
set (the router refers to that name unconditionally); nothing else of the CPU shim is used.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import torch

# the CPU grid's scenarios are r3bridge's own tests (tests/megatron); worker processes inherit this
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "megatron"))

CELLS = ["tp2_sp", "cp2", "pp2_1f1b", "pp2_vpp2", "ep2", "full_recompute", "moe_recompute", "mtp",
         "pp2_uneven_dense_stage"]


def gpu_cells(names):
    from replay_grid import default_cells

    out = []
    for c in default_cells():
        if c.name in names:
            spec = dataclasses.replace(
                c.spec, moe_token_dispatcher_type="alltoall", attention="identity",
                extra_config={**c.spec.extra_config, "bf16": True, "params_dtype": torch.bfloat16,
                              "pipeline_dtype": torch.bfloat16})
            out.append(dataclasses.replace(c, spec=spec))
    return out


def worker(rank: int, world: int, port: int, names: list[str], q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils
    from replay_grid import cell_world_size, run_cell

    from r3bridge.testing.dist import _init_layout

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=90),
                                         device_id=torch.device("cuda", rank))
    results = {}
    for cell in gpu_cells(names):
        if cell_world_size(cell) > world:
            continue
        t0 = time.time()
        try:
            ctx = _init_layout(cell.layout, rank, world, 1234)
            try:
                res = run_cell(ctx, cell, serial=False, device="cuda")
            finally:
                ps.destroy_model_parallel()
        except Exception:  # noqa: BLE001
            res = {"error": traceback.format_exc()}
        res.pop("recorded", None)
        res["seconds"] = round(time.time() - t0, 2)
        brief = res["error"][-800:] if "error" in res else {k: res[k] for k in ("r3_errors", "r2_logits_equal", "state_clean")}
        print(f"[rank {rank}] {cell.name} {res['seconds']}s {brief}", file=sys.stderr, flush=True)
        results[cell.name] = res
    q.put((rank, results))
    torch.distributed.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--cells", default=",".join(CELLS), help="comma-separated cell names, or 'all' (the whole CPU grid)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.cells == "all":
        from replay_grid import default_cells
        a.cells = ",".join(c.name for c in default_cells())
    mp = torch.multiprocessing.get_context("spawn")
    q = mp.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [mp.Process(target=worker, args=(r, a.gpus, port, a.cells.split(","), q)) for r in range(a.gpus)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=1200) for _ in procs)
    for pr in procs:
        pr.join(60)
    ok = True
    summary = {}
    for name in a.cells.split(","):
        per_rank = [got[r].get(name) for r in range(a.gpus)]
        if per_rank[0] is None:
            summary[name] = "skipped (needs more GPUs)"
            continue
        errs = [x["error"] for x in per_rank if "error" in x]
        if errs:
            ok = False
            summary[name] = {"error": errs[0][-1500:]}
            continue
        passed = all(not x["r3_errors"] and x["state_clean"] and x["r2_agreement"] == 1.0
                     and (x["r2_logits_equal"] or not x["r2_logits_compared"])
                     and x.get("tensor_growth", 0) <= 0 and x.get("device_bytes_growth", 0) <= 0 for x in per_rank)
        ok &= passed
        summary[name] = {"pass": passed, "r3_errors": sum(len(x["r3_errors"]) for x in per_rank),
                         "r2_logits_bit_equal": all(x["r2_logits_equal"] for x in per_rank if x["r2_logits_compared"]),
                         "r2_logits_maxdiff": max(x["r2_logits_maxdiff"] for x in per_rank),
                         "coverage": per_rank[0]["r3_metrics"].get("r3bridge/coverage"),
                         "agreement_random_targets": per_rank[0]["r3_metrics"].get("r3bridge/agreement/mean"),
                         "seconds": max(x["seconds"] for x in per_rank)}
        if "tensor_growth" in per_rank[0]:   # cells with memory_steps: nothing may accumulate
            summary[name]["tensor_growth"] = max(x["tensor_growth"] for x in per_rank)
            summary[name]["tensor_bytes_growth"] = max(x["tensor_bytes_growth"] for x in per_rank)
            summary[name]["device_bytes_growth"] = max(x["device_bytes_growth"] for x in per_rank)
    info = {"device": torch.cuda.get_device_name(0), "gpus": a.gpus, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cells": summary, "all_pass": ok}
    text = json.dumps(info, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
