"""GPU conformance: the cells of the CPU grid on NCCL, bf16, alltoall dispatcher.

    python scripts/gpu/nccl_conformance.py [--gpus 2] [--cells tp2_sp,pp2_1f1b,...|all]
                                           [--cell-timeout 300] [--json OUT] [--device cuda|cpu]
                                           [--spec local|te]

Each cell (tests/megatron/replay_grid.py: ``default_cells``, the CPU grid, and ``gpu_cells``) runs
replay_grid's run_cell (R3 forward-only then training step checked router call by router call
against an independent packing reference, R2 record + replay with bit-identical logits, no state
left, and the gradient check: every parameter's gradient, the losses and the aux-loss terms of R2's
replay vs the native step and of R3's replay vs the same routes forced without r3bridge, printed
per cell as "bit-equal" or as the largest difference bounded by the native step's own run-to-run
spread, ``gradient_verdict``) on CUDA with NCCL, one process per GPU. The TP=PP=CP=1
comparison of the CPU grid is skipped: bf16 kernels differ across layouts.
Without Transformer Engine only ``moe_utils.te_general_gemm = None`` is set (the 0.16 router refers
to that name unconditionally); nothing else of the CPU shim is used.

Fail fast, never hang: every cell gets a fresh set of processes (r3bridge.testing.harness.dist.spawn_layouts).
A rank whose cell raises reports its traceback and the parent kills every rank of that cell at once
(the others would otherwise wait in a collective until the process-group timeout); a cell that does
not finish within ``--cell-timeout`` seconds is killed the same way. Either is reported for that
cell (which rank, what error) and the next cell starts in new processes.

``--spec te`` builds every model on Transformer Engine's layer spec (TE attention on packed THD
input, TEGroupedMLP, alltoall, bf16; needs CUDA and transformer-engine) and adds the cells that fit
one GPU (``TE_CELLS``: the grid's model variants at TP=PP=EP=1, and the TE-only paths that touch
routing: permute fusion, FP8, router fusion, CUDA graphs). A cell expected to be refused passes when
r3bridge's guard raises ConfigError naming the option, before any step runs. Every router call of
the R3 forward-only and training passes and of the R2 replay is compared row by row with its
targets; the summary gives the calls and rows checked and the rows that differ.

``--device cpu`` runs the same cells on gloo with the CPU shim (the CPU grid's specs, no bf16):
how the fail-fast path is tested without GPUs (tests/megatron/test_gpu_script.py).
``R3BRIDGE_CONFORMANCE_FAULT=<cell>:<rank>:raise|raise_mid|hang[,...]`` makes one rank of a cell
raise (at its start, or in its first training micro-batch) or hang; only that test and the FAILFAST
cells (``failfast_tp2_sp``, ``failfast_pp4``: a failure shown on purpose, passing when the failed rank
is reported and every rank is gone within FAILFAST_LIMIT_S of the raise) set it.

scripts/gpu/nccl_grid.py runs the whole grid for one or more megatron-core releases at 2 and 4 GPUs
in parallel lanes of this script.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

import torch

# the grid's scenarios are r3bridge's own tests (tests/megatron); spawned ranks inherit sys.path
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "megatron"))

CELLS = ["tp2_sp", "cp2", "pp2_1f1b", "pp2_vpp2", "ep2", "ep2_alltoall", "full_recompute", "moe_recompute", "mtp",
         "pp2_uneven_dense_stage"]
FAULT_ENV = "R3BRIDGE_CONFORMANCE_FAULT"
# Cells that must fail, on purpose: the grid cell named on the right with one rank raising in its
# first micro-batch of the R3 training pass (FAULT_ENV kind raise_mid). They pass when the run
# reports that rank and its traceback and every rank of the cell is gone within FAILFAST_LIMIT_S of
# the raise (the others would otherwise wait in a collective until the process-group timeout).
FAILFAST = {"failfast_tp2_sp": ("tp2_sp", 1), "failfast_pp4": ("pp4_uneven_dense_stage", 3)}
FAILFAST_LIMIT_S = 30.0
# cells whose guard must refuse the config (ConfigError naming the option) instead of replaying
# megatron-core 0.16.1's unpermute (moe_utils.unpermute) sums each token's top-k expert outputs with
# scatter_add_ (CUDA atomics, in no fixed order) unless torch's deterministic algorithms are on
# (then index_add_). A sum of two terms from zero is order-free (0+a+b == 0+b+a), so top-2 cells are
# bit-stable; top-6 is not: two passes with the same routes can differ in the last bf16 bit. The
# cell runs both ways: natively (logits may differ, routes are still checked row by row) and with
# deterministic algorithms (logits must be bit-equal).
LOGITS_MAY_DIFFER = {"te_int16_ids"}
# the grid's top-6 cell runs on GPUs with deterministic algorithms for the same reason
DETERMINISTIC = {"te_int16_ids_deterministic", "tp2_pp2_int16_ids"}
REFUSED = {"te_router_fusion": "moe_router_fusion", "te_cuda_graphs_te": "CUDA graphs capture the router",
           "te_cuda_graphs_local": "CUDA graphs capture the router"}


def te_cells() -> list[Any]:
    """One-GPU cells on the TE layer spec (head dim 16 and GEMM sizes divisible by 16, for FP8)."""
    from replay_grid import Cell

    from r3bridge.testing.harness.dist import Layout
    from r3bridge.testing.harness.models import ModelSpec

    def te(**kw: Any) -> ModelSpec:
        extra = kw.pop("extra_config", {})
        return ModelSpec(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, layer_spec="te",
                         extra_config=extra, **kw)

    one = Layout()
    # totals that are multiples of 16 without any padding (FP8 GEMMs need it), for the cell whose
    # packing comes from the layout alone
    lens16 = ((13, 7, 28), (9, 15, 8), (21, 5, 6))
    return [
        Cell("te_base", one, te()),
        Cell("te_first_k_dense", one, te(num_layers=4, moe_layer_freq=[0, 1, 1, 1])),
        Cell("te_int_freq_2", one, te(num_layers=4, moe_layer_freq=2)),
        Cell("te_full_recompute", one, te(recompute="full")),
        Cell("te_moe_recompute", one, te(recompute="moe")),
        Cell("te_mtp", one, te(num_layers=4, mtp_num_layers=1)),
        Cell("te_int16_ids", one, te(num_moe_experts=320, moe_router_topk=6)),
        Cell("te_int16_ids_deterministic", one, te(num_moe_experts=320, moe_router_topk=6)),
        Cell("te_permute_fusion", one, te(extra_config={"moe_permute_fusion": True})),
        Cell("te_fp8_hybrid", one, te(extra_config={"fp8": "hybrid"})),
        Cell("te_fp8_e4m3", one, te(extra_config={"fp8": "e4m3"})),
        Cell("te_fp8_hybrid_tensorwise", one, te(extra_config={"fp8": "hybrid", "fp8_recipe": "tensorwise"})),
        # no cu_seqlens_padded: the plan must be the model's real (unpadded) packing, not an FP8
        # padding rule guessed from config.fp8 (field notes 14: "router sees 608 rows, plan 640")
        Cell("te_fp8_layout_packing", one, te(extra_config={"fp8": "hybrid"}), packing="layout", seq_lens=lens16),
        Cell("te_fp8_permute_fusion", one, te(extra_config={"fp8": "hybrid", "moe_permute_fusion": True})),
        Cell("te_router_fusion", one, te(extra_config={"moe_router_fusion": True})),
        # TE CUDA graphs of the whole layer (megatron's default scope) capture the router
        Cell("te_cuda_graphs_te", one, te(extra_config={"cuda_graph_impl": "transformer_engine"})),
        Cell("te_cuda_graphs_local", one, te(extra_config={"cuda_graph_impl": "local"})),
    ]


def select_cells(names: list[str], device: str, layer_spec: str = "local") -> list[Any]:
    from replay_grid import default_cells, gpu_cells

    known = {c.name: c for c in default_cells() + gpu_cells()}
    known.update({name: dataclasses.replace(known[base], name=name) for name, (base, _) in FAILFAST.items()})
    if layer_spec == "te":
        known.update({c.name: c for c in te_cells()})
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; known: {sorted(known)}")
    out = []
    for name in names:
        c = known[name]
        if device == "cuda":
            # the local spec has no THD attention and no CP: identity attention; TE has both
            attention = "real" if layer_spec == "te" else "identity"
            dispatcher = c.spec.moe_token_dispatcher_type if c.pinned_dispatcher else "alltoall"
            spec = dataclasses.replace(
                c.spec, moe_token_dispatcher_type=dispatcher, attention=attention, layer_spec=layer_spec,
                extra_config={**c.spec.extra_config, "bf16": True, "params_dtype": torch.bfloat16,
                              "pipeline_dtype": torch.bfloat16})
            c = dataclasses.replace(c, spec=spec)
        elif layer_spec == "te":
            c = dataclasses.replace(c, spec=dataclasses.replace(c.spec, layer_spec="te"))
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
        if kind == "raise_mid":
            _raise_in_training_step(cell, rank)
            continue
        raise ValueError(f"{FAULT_ENV}: kind must be 'raise', 'raise_mid' or 'hang', got {kind!r}")


def _raise_in_training_step(cell: str, rank: int) -> None:
    """This rank raises in its first micro-batch of the R3 training pass, after the forward-only pass
    ran on every rank: the other ranks are then inside the training schedule's collectives (TP
    all-gathers, pipeline p2p), where they would wait for this rank until the process-group timeout.
    The grid's forward steps come from ``replay_grid.make_forward_step``: this process's copy of that
    name is wrapped (test-only fault injection, nothing else changes)."""
    import replay_grid

    inner_factory = replay_grid.make_forward_step

    def factory(*args: Any, **kwargs: Any) -> Any:
        inner = inner_factory(*args, **kwargs)

        def forward_step(data_iterator: Any, model: Any) -> Any:
            if torch.is_grad_enabled():
                raise RuntimeError(f"injected fault: cell {cell} rank {rank} (in the training step, {FAULT_ENV}) "
                                   f"at t={time.time():.3f}")
            return inner(data_iterator, model)
        return forward_step

    replay_grid.make_forward_step = factory


def cell_rank(ctx: Any, cell: Any, device: str) -> dict[str, Any]:
    """Rank function: one cell on this rank. Raises on failure, so the parent aborts the others."""
    from replay_grid import run_cell

    _injected_fault(cell.name, ctx.rank)
    t0 = time.time()
    if cell.name in REFUSED:
        return refused_rank(ctx, cell)
    if cell.name in DETERMINISTIC:
        torch.use_deterministic_algorithms(True, warn_only=True)
    res = run_cell(ctx, cell, serial=False, device=device)
    if "error" in res:           # run_cell reports per cell; here a failure must stop the group
        raise RuntimeError(f"cell {cell.name} failed on rank {ctx.rank}:\n{res['error']}")
    res.pop("recorded", None)
    res["seconds"] = round(time.time() - t0, 2)
    return res


def refused_rank(ctx: Any, cell: Any) -> dict[str, Any]:
    """A cell whose config r3bridge must refuse: build the model, attach a Replayer, expect
    ConfigError naming the option; anything else (no error, another error) fails the cell."""
    from r3bridge.errors import ConfigError
    from r3bridge.megatron import Replayer
    from r3bridge.testing.harness.models import build_model_chunks

    if cell.spec.extra_config.get("cuda_graph_impl") == "local":
        # megatron's local CUDA graphs need a graph-safe RNG tracker to build the model at all
        # (cuda_graphs.py: "RNG tracker does not support cudagraphs!"): TE's, as Megatron-LM sets
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cell.spec.seed, te_rng_tracker=True, force_reset_rng=True)
    chunks = build_model_chunks(cell.spec, ctx)
    try:
        Replayer(chunks)
    except ConfigError as e:
        if REFUSED[cell.name] not in str(e):
            raise RuntimeError(f"cell {cell.name}: refused, but the message does not name "
                               f"{REFUSED[cell.name]!r}: {e}") from e
        return {"refused": str(e)}
    raise RuntimeError(f"cell {cell.name}: r3bridge accepted a config it must refuse")


# The gradient check may bound instead of match only where the native step itself is not
# reproducible: the replay-vs-reference difference must stay within SPREAD_FACTOR x the largest
# difference between two native steps of the same weights and batch (run when a match fails).
SPREAD_FACTOR = 2.0


def gradient_verdict(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The gradient check of every rank (replay_grid's ``grad``): per comparison "bit-equal", or the
    largest gradient difference against the native step's own run-to-run spread, or FAIL."""
    runs = [x["grad"] for x in per_rank if "grad" in x]
    if not runs:
        return {"gradient_check": "not run"}
    spread = max((g["native_spread"]["grad_maxdiff"] for g in runs if "native_spread" in g), default=0.0)
    spread_exact = all(g["native_spread"]["grads_equal"] for g in runs if "native_spread" in g)
    out: dict[str, Any] = {"native_route_errors": sum(len(g["native_route_errors"]) for g in runs),
                           "r3_differs_from_native": all(g["r3_differs_from_native"] for g in runs)}
    # every router has its r3bridge hook back after the forced reference, no pass left open
    out["grad_state_clean"] = all(g.get("state_clean", True) for g in runs)
    ok = out["native_route_errors"] == 0 and out["r3_differs_from_native"] and out["grad_state_clean"]
    for key in ("r2_vs_native", "r3_vs_forced"):
        xs = [g[key] for g in runs]
        exact = all(x["grads_equal"] and x["losses_equal"] and x["terms_equal"] for x in xs)
        diff = max(x["grad_maxdiff"] for x in xs)
        if exact:
            verdict = "bit-equal"
        elif not spread_exact and all(not x["only_one_side"] for x in xs) and diff <= SPREAD_FACTOR * spread:
            verdict = f"bound: max |d| {diff:.3g} <= {SPREAD_FACTOR:g} x native spread {spread:.3g}"
        else:
            verdict = f"FAIL: max |d| {diff:.3g}, native spread {spread:.3g}, {sum(len(x['differing']) for x in xs)} differing"
            ok = False
        out[key] = verdict
        out[f"{key}_params"] = sum(x["params"] for x in xs)
    broken = [g["broken_vs_native"] for g in runs if "broken_vs_native" in g]
    if broken:
        # the broken-backward step (mori #675): forward right, gradients must be caught
        caught = all(not b["grads_equal"] and b["losses_equal"] for b in broken) and \
            all(not g["broken_route_errors"] for g in runs if "broken_vs_native" in g)
        out["broken_backward"] = "caught" if caught else "NOT CAUGHT"
        ok &= caught
    out["gradient_pass"] = ok
    return out


def summarize(per_rank: list[dict[str, Any]], cell_name: str = "") -> dict[str, Any]:
    if "refused" in per_rank[0]:
        return {"pass": True, "refused_by_guard": per_rank[0]["refused"]}
    grad = gradient_verdict(per_rank)
    logits_may_differ = cell_name in LOGITS_MAY_DIFFER
    # in such a cell the replay pass's *native* top-k (the agreement metric's reference) sees
    # hidden states that differ in the last bit too, so agreement may fall below 1; the routes
    # dispatched are still checked row by row (r2_errors)
    passed = all(not x["r3_errors"] and not x.get("r2_errors") and x["state_clean"]
                 and (x["r2_agreement"] == 1.0 or logits_may_differ)
                 and (x["r2_logits_equal"] or not x["r2_logits_compared"] or logits_may_differ)
                 and x.get("tensor_growth", 0) <= 0 and x.get("device_bytes_growth", 0) <= 0 for x in per_rank)
    passed = passed and grad.get("gradient_pass", True)
    out = {"pass": passed, **grad, "r3_errors": sum(len(x["r3_errors"]) for x in per_rank),
           "r2_logits_bit_equal": all(x["r2_logits_equal"] for x in per_rank if x["r2_logits_compared"]),
           "r2_logits_maxdiff": max(x["r2_logits_maxdiff"] for x in per_rank),
           "coverage": per_rank[0]["r3_metrics"].get("r3bridge/coverage"),
           "r2_agreement": min(x["r2_agreement"] for x in per_rank),
           "state_clean": all(x["state_clean"] for x in per_rank),
           "agreement_random_targets": per_rank[0]["r3_metrics"].get("r3bridge/agreement/mean"),
           "seconds": max(x["seconds"] for x in per_rank)}
    if logits_may_differ:
        out["r2_logits_note"] = ("top-k > 2 outputs summed by scatter_add_ in no fixed order (megatron "
                                 "moe_utils.unpermute); see the _deterministic cell")
    for k in ("r3_router_calls_checked", "r3_rows_checked", "r3_mismatching_rows",
              "r2_router_calls_checked", "r2_rows_checked", "r2_mismatching_rows"):
        if k in per_rank[0]:
            out[k] = sum(x[k] for x in per_rank)
    if "tensor_growth" in per_rank[0]:   # cells with memory_steps: nothing may accumulate
        for k in ("tensor_growth", "tensor_bytes_growth", "device_bytes_growth"):
            if k in per_rank[0]:
                out[k] = max(x[k] for x in per_rank)
    return out


def run_one(cell: Any, world: int, device: str, timeout: float) -> dict[str, Any]:
    """One cell in its own processes; a failure or timeout is a result, never a hang."""
    from replay_grid import cell_world_size

    if cell_world_size(cell) > world:
        return {"pass": None, "skipped": f"needs {cell_world_size(cell)} ranks, {world} available"}
    if cell.name in FAILFAST:
        return run_failfast(cell, world, device, timeout)
    return _spawn_result(cell, world, device, timeout)


def _spawn_result(cell: Any, world: int, device: str, timeout: float) -> dict[str, Any]:
    from r3bridge.testing.harness.dist import RankError, spawn_layouts

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
    return summarize(per_rank, cell.name)


def run_failfast(cell: Any, world: int, device: str, timeout: float) -> dict[str, Any]:
    """A cell that must fail: one rank raises (FAILFAST), the others would block in a collective.
    Passes when the run names that rank and the injected error and every rank of the cell has been
    ended (``spawn_layouts`` kills and joins them) within FAILFAST_LIMIT_S of the raise (the fault's
    message carries its time)."""
    _, rank = FAILFAST[cell.name]
    before = os.environ.get(FAULT_ENV)
    os.environ[FAULT_ENV] = ",".join(filter(None, [before, f"{cell.name}:{rank}:raise_mid"]))
    try:                             # the spawned ranks read the variable at start
        res = _spawn_result(cell, world, device, timeout)
    finally:
        if before is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = before
    ended = time.time()              # _spawn_result returns once every rank is killed and joined
    found = re.search(rf"injected fault: cell {re.escape(cell.name)} rank {rank} .* at t=([0-9.]+)", res.get("error", ""))
    after_fault = round(ended - float(found.group(1)), 2) if found else None
    caught = res.get("failed_rank") == rank and after_fault is not None and after_fault < FAILFAST_LIMIT_S
    return {"pass": bool(caught), "expected_failure": f"rank {rank} raises in its first training micro-batch",
            "failed_rank": res.get("failed_rank"), "all_ranks_ended_s_after_fault": after_fault,
            "aborted_after_s": res.get("aborted_after_s"), "cell_timeout_s": timeout,
            "error": res.get("error", "")[-600:]}


def _te_version() -> str | None:
    try:
        import transformer_engine
    except ImportError:
        return None
    return str(transformer_engine.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: all GPUs; 2 with --device cpu)")
    p.add_argument("--cell-timeout", type=float, default=300.0,
                   help="seconds per cell, process start included; the cell's ranks are killed after it")
    p.add_argument("--json", default=None)
    p.add_argument("--spec", choices=["local", "te"], default="local",
                   help="layer spec: megatron-core's local modules, or Transformer Engine's")
    p.add_argument("--cells", dest="cells", default=None,
                   help="comma-separated cell names, or 'all' (the CPU grid and gpu_cells, plus TE_CELLS with "
                        "--spec te; not the FAILFAST cells); default: CELLS, plus TE_CELLS with --spec te")
    a = p.parse_args(argv)
    world = a.gpus if a.gpus is not None else (torch.cuda.device_count() if a.device == "cuda" else 2)
    if a.spec == "te":
        from r3bridge.testing.harness.models import require_te
        require_te()     # a clear error naming the package, before any rank starts
    if a.cells is None:
        a.cells = ",".join(CELLS + ([c.name for c in te_cells()] if a.spec == "te" else []))
    elif a.cells == "all":
        from replay_grid import default_cells, gpu_cells
        a.cells = ",".join([c.name for c in default_cells() + gpu_cells()]
                           + ([c.name for c in te_cells()] if a.spec == "te" else []))
    if a.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        # cuBLAS needs a fixed workspace for deterministic algorithms (the _deterministic cells)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    summary: dict[str, Any] = {}
    ok = True
    for cell in select_cells(a.cells.split(","), a.device, a.spec):
        res = run_one(cell, world, a.device, a.cell_timeout)
        summary[cell.name] = res
        ok &= res["pass"] is not False
        brief = {k: res[k] for k in ("pass", "failed_rank", "skipped", "seconds", "aborted_after_s",
                                     "all_ranks_ended_s_after_fault", "r3_rows_checked", "r3_mismatching_rows",
                                     "r2_rows_checked", "r2_mismatching_rows", "r2_vs_native", "r3_vs_forced",
                                     "broken_backward") if k in res}
        if "refused_by_guard" in res:
            brief["refused_by_guard"] = res["refused_by_guard"][:160]
        print(f"{cell.name}: {brief}", file=sys.stderr, flush=True)
    from r3bridge.megatron.compat import megatron_version

    info = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (gloo)",
            "ranks": world, "torch": torch.__version__, "layer_spec": a.spec,
            "transformer_engine": _te_version(),
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
