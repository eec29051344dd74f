"""GPU conformance: the cells of the CPU grid on NCCL, bf16, alltoall dispatcher.

    python scripts/gpu/nccl_conformance.py [--gpus 2] [--cells tp2_sp,pp2_1f1b,...|all]
                                           [--cell-timeout 300] [--json OUT] [--device cuda|cpu]

Each cell runs tests/megatron/replay_grid.py's run_cell (R3 forward-only then training step checked
router call by router call against an independent packing reference, R2 record + replay with
bit-identical logits, no state left) on CUDA with NCCL, one process per GPU. The TP=PP=CP=1
comparison of the CPU grid is skipped: bf16 kernels differ across layouts.
Without Transformer Engine only ``moe_utils.te_general_gemm = None`` is set (the 0.16 router refers
to that name unconditionally); nothing else of the CPU shim is used.

Fail fast, never hang: every cell gets a fresh set of processes (r3bridge.testing.dist.spawn_layouts).
A rank whose cell raises reports its traceback and the parent kills every rank of that cell at once
(the others would otherwise wait in a collective until the process-group timeout); a cell that does
not finish within ``--cell-timeout`` seconds is killed the same way. Either is reported for that
cell (which rank, what error) and the next cell starts in new processes.

``--device cpu`` runs the same cells on gloo with the CPU shim (the CPU grid's specs, no bf16):
how the fail-fast path is tested without GPUs (tests/megatron/test_gpu_script.py).
``R3BRIDGE_CONFORMANCE_FAULT=<cell>:<rank>:raise|hang[,...]`` makes one rank of a cell raise or
hang; only that test sets it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

# the grid's scenarios are r3bridge's own tests (tests/megatron); spawned ranks inherit sys.path
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "megatron"))

CELLS = ["tp2_sp", "cp2", "pp2_1f1b", "pp2_vpp2", "ep2", "full_recompute", "moe_recompute", "mtp",
         "pp2_uneven_dense_stage"]
FAULT_ENV = "R3BRIDGE_CONFORMANCE_FAULT"


def select_cells(names: list[str], device: str) -> list[Any]:
    from replay_grid import default_cells

    known = {c.name: c for c in default_cells()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; known: {sorted(known)}")
    out = []
    for name in names:
        c = known[name]
        if device == "cuda":
            spec = dataclasses.replace(
                c.spec, moe_token_dispatcher_type="alltoall", attention="identity",
                extra_config={**c.spec.extra_config, "bf16": True, "params_dtype": torch.bfloat16,
                              "pipeline_dtype": torch.bfloat16})
            c = dataclasses.replace(c, spec=spec)
        out.append(c)
    return out


def _injected_fault(cell: str, rank: int) -> None:
    """Test-only fault injection (see module docstring)."""
    for fault in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        name, fault_rank, kind = fault.split(":")
        if name != cell or int(fault_rank) != rank:
            continue
        if kind == "raise":
            raise RuntimeError(f"injected fault: cell {cell} rank {rank} ({FAULT_ENV})")
        if kind == "hang":
            while True:
                time.sleep(1)
        raise ValueError(f"{FAULT_ENV}: kind must be 'raise' or 'hang', got {kind!r}")


def cell_rank(ctx: Any, cell: Any, device: str) -> dict[str, Any]:
    """Rank function: one cell on this rank. Raises on failure, so the parent aborts the others."""
    from replay_grid import run_cell

    _injected_fault(cell.name, ctx.rank)
    t0 = time.time()
    res = run_cell(ctx, cell, serial=False, device=device)
    if "error" in res:           # run_cell reports per cell; here a failure must stop the group
        raise RuntimeError(f"cell {cell.name} failed on rank {ctx.rank}:\n{res['error']}")
    res.pop("recorded", None)
    res["seconds"] = round(time.time() - t0, 2)
    return res


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    passed = all(not x["r3_errors"] and x["state_clean"] and x["r2_agreement"] == 1.0
                 and (x["r2_logits_equal"] or not x["r2_logits_compared"])
                 and x.get("tensor_growth", 0) <= 0 and x.get("device_bytes_growth", 0) <= 0 for x in per_rank)
    out = {"pass": passed, "r3_errors": sum(len(x["r3_errors"]) for x in per_rank),
           "r2_logits_bit_equal": all(x["r2_logits_equal"] for x in per_rank if x["r2_logits_compared"]),
           "r2_logits_maxdiff": max(x["r2_logits_maxdiff"] for x in per_rank),
           "coverage": per_rank[0]["r3_metrics"].get("r3bridge/coverage"),
           "agreement_random_targets": per_rank[0]["r3_metrics"].get("r3bridge/agreement/mean"),
           "seconds": max(x["seconds"] for x in per_rank)}
    if "tensor_growth" in per_rank[0]:   # cells with memory_steps: nothing may accumulate
        for k in ("tensor_growth", "tensor_bytes_growth", "device_bytes_growth"):
            if k in per_rank[0]:
                out[k] = max(x[k] for x in per_rank)
    return out


def run_one(cell: Any, world: int, device: str, timeout: float) -> dict[str, Any]:
    """One cell in its own processes; a failure or timeout is a result, never a hang."""
    from replay_grid import cell_world_size

    from r3bridge.testing.dist import RankError, spawn_layouts

    if cell_world_size(cell) > world:
        return {"pass": None, "skipped": f"needs {cell_world_size(cell)} ranks, {world} available"}
    t0 = time.time()
    try:
        per_rank = spawn_layouts(cell_rank, world_size=world, layouts=[cell.layout], args=(cell, device),
                                 timeout=timeout, backend="nccl" if device == "cuda" else "gloo")[0]
    except RankError as e:
        return {"pass": False, "failed_rank": e.rank, "error": e.remote_traceback[-1500:],
                "aborted_after_s": round(time.time() - t0, 1)}
    except TimeoutError as e:
        return {"pass": False, "failed_rank": None, "error": f"timeout: {e}",
                "aborted_after_s": round(time.time() - t0, 1)}
    except RuntimeError as e:    # a rank died without reporting (e.g. a segfault)
        return {"pass": False, "failed_rank": None, "error": str(e)[-1500:],
                "aborted_after_s": round(time.time() - t0, 1)}
    return summarize(per_rank)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: all GPUs; 2 with --device cpu)")
    p.add_argument("--cells", default=",".join(CELLS), help="comma-separated cell names, or 'all' (the whole CPU grid)")
    p.add_argument("--cell-timeout", type=float, default=300.0,
                   help="seconds per cell, process start included; the cell's ranks are killed after it")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    world = a.gpus if a.gpus is not None else (torch.cuda.device_count() if a.device == "cuda" else 2)
    if a.cells == "all":
        from replay_grid import default_cells
        a.cells = ",".join(c.name for c in default_cells())
    if a.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    summary: dict[str, Any] = {}
    ok = True
    for cell in select_cells(a.cells.split(","), a.device):
        res = run_one(cell, world, a.device, a.cell_timeout)
        summary[cell.name] = res
        ok &= res["pass"] is not False
        brief = {k: res[k] for k in ("pass", "failed_rank", "skipped", "seconds", "aborted_after_s") if k in res}
        print(f"{cell.name}: {brief}", file=sys.stderr, flush=True)
    from r3bridge.megatron.compat import megatron_version

    info = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (gloo)",
            "ranks": world, "torch": torch.__version__,
            "megatron_core": ".".join(map(str, megatron_version())),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if a.device == "cuda" else None,
            "cells": summary, "all_pass": ok}
    text = json.dumps(info, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
