"""Conformance tests of the CPU megatron harness (r3bridge.testing).

Every layout cell builds a real megatron-core GPT+MoE model on gloo ranks, runs a forward-only
schedule, a 3-micro-batch training schedule, an SGD step and another forward-only schedule,
and the RoutingProbe records every router call. The expectations below are computed
independently of megatron (row order, layer placement and schedules as docs/architecture.md states them), so they check both the harness and
the facts the replay driver relies on.

Process starts dominate the runtime (importing megatron costs ~5-10 s per process), so all
2-rank layouts share one spawn and all 4-rank layouts another (module-scoped fixtures).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import pytest
import torch
from cells import Cell, CellResult, run_cells

from r3bridge.testing.harness import dist
from r3bridge.testing.harness.data import (
    align_for,
    cp_zigzag_index,
    make_packed_batch,
    real_token_positions,
    router_row_index,
)
from r3bridge.testing.harness.dist import Layout
from r3bridge.testing.harness.models import ModelSpec

pytestmark = pytest.mark.slow

M = 3  # micro-batches per schedule
SEQ_LENS = [[20, 12], [16], [9, 9, 5]]  # packed sequences per micro-batch
SEQ_LENS_VAR = [[20, 12], [7], [9, 9, 5]]  # different packed totals (alltoall only)

BASE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            vocab_size=128, num_moe_experts=4, moe_router_topk=2)
# Specs compared with a reference run have no aux loss: padding rows are routed and count in
# the aux loss, and alignment padding differs between layouts (tp/cp), so the aux-loss
# gradient (not the logits) legitimately differs across layouts.
NOAUX = dict(BASE, moe_aux_loss_coeff=0.0)
SPEC_REAL = ModelSpec(**NOAUX)
SPEC_IDENT = ModelSpec(**NOAUX, attention="identity")
SPEC_MTP = ModelSpec(**NOAUX, mtp_num_layers=1)
SPEC_FULL = ModelSpec(**NOAUX, recompute="full")
SPEC_MOE_RC = ModelSpec(**NOAUX, recompute="moe")
SPEC_A2A = ModelSpec(**NOAUX, moe_token_dispatcher_type="alltoall")
# Probe-only cells keep the default aux loss (1e-2) so its training-only path runs too.
SPEC_UNEVEN = ModelSpec(**{**BASE, "num_layers": 6}, num_layers_in_first_pipeline_stage=1,
                        num_layers_in_last_pipeline_stage=5, moe_layer_freq=[0, 1, 1, 1, 1, 1])
SPEC_FREQ2 = ModelSpec(**BASE, moe_layer_freq=2)
SPEC_FULL_AUX = ModelSpec(**BASE, recompute="full")
SPEC_MTP_FULL = ModelSpec(**BASE, mtp_num_layers=1, recompute="full")
SPEC_A2A_AUX = ModelSpec(**BASE, moe_token_dispatcher_type="alltoall")


def cell(name: str, spec: ModelSpec, seq_lens: Optional[list[list[int]]] = None) -> Cell:
    return Cell(name=name, spec=spec, seq_lens=seq_lens or SEQ_LENS)


W1 = Layout()
TP2, CP2, PP2, VPP, EP2 = Layout(tp=2), Layout(cp=2), Layout(pp=2), Layout(pp=2, vpp=2), Layout(ep=2)
TP2_ETP2 = Layout(tp=2, etp=2)  # experts TP-sharded too (megatron's default etp=tp)
TP2EP2, TP2CP2 = Layout(tp=2, ep=2), Layout(tp=2, cp=2)

# Layout() on 2 ranks is dp=2 with identical data: numerically the TP=PP=1 reference.
PLAN2: dict[Layout, list[Cell]] = {
    W1: [cell("ref_real", SPEC_REAL), cell("ref_ident", SPEC_IDENT), cell("ref_mtp", SPEC_MTP)],
    TP2: [cell("tp2", SPEC_REAL)],
    TP2_ETP2: [cell("tp2_etp2", SPEC_REAL)],
    CP2: [cell("cp2", SPEC_IDENT)],
    PP2: [
        cell("pp2", SPEC_REAL),
        cell("pp2_uneven_dense_first", SPEC_UNEVEN),
        cell("pp2_freq2", SPEC_FREQ2),
        cell("pp2_mtp", SPEC_MTP),
        cell("pp2_mtp_full_recompute", SPEC_MTP_FULL),
        cell("pp2_full_recompute", SPEC_FULL),
        cell("pp2_full_recompute_aux", SPEC_FULL_AUX),
        cell("pp2_moe_recompute", SPEC_MOE_RC),
        cell("pp2_alltoall_varlen", SPEC_A2A_AUX, SEQ_LENS_VAR),
    ],
    VPP: [cell("pp2_vpp2", SPEC_REAL)],
    EP2: [cell("ep2", SPEC_REAL), cell("ep2_alltoall", SPEC_A2A)],
}
PLAN4: dict[Layout, list[Cell]] = {
    TP2EP2: [cell("tp2_ep2", SPEC_REAL)],
    TP2CP2: [cell("tp2_cp2", SPEC_IDENT)],
}
PLAN1: dict[Layout, list[Cell]] = {
    W1: [Cell("w1_real", SPEC_REAL, SEQ_LENS, return_state=True)]}
SPEC_OTHER_SEED = ModelSpec(**NOAUX, seed=999)  # init differs; the loaded state makes it equal
LOADED = {  # layout -> cell name, each loading w1_real's canonical state (load_reference_state)
    TP2: "tp2_loaded", VPP: "pp2_vpp2_loaded", EP2: "ep2_loaded"}
REFERENCE = {"real": "ref_real", "identity": "ref_ident", "mtp": "ref_mtp"}


def _run(world_size: int, plan: dict[Layout, list[Cell]]) -> dict[str, list[CellResult]]:
    t0 = time.monotonic()
    per_layout = dist.spawn_layouts(run_cells, world_size=world_size, layouts=list(plan),
                                    args=(plan,), timeout=900)
    out: dict[str, list[CellResult]] = {}
    for ranks in per_layout:
        for rank_results in ranks:
            for res in rank_results:
                out.setdefault(res.name, []).append(res)
    print(f"spawn world_size={world_size}: {time.monotonic() - t0:.1f}s")
    return out


@pytest.fixture(scope="module")
def w2(w1: dict[str, list[CellResult]]) -> dict[str, list[CellResult]]:
    state = w1["w1_real"][0].state
    assert state is not None
    plan = {lay: list(cells) for lay, cells in PLAN2.items()}
    for lay, name in LOADED.items():
        plan[lay].append(Cell(name, SPEC_OTHER_SEED, SEQ_LENS, load_state=state))
    plan[TP2].append(cell("tp2_other_seed", SPEC_OTHER_SEED))
    return _run(2, plan)


@pytest.fixture(scope="module")
def w4() -> dict[str, list[CellResult]]:
    return _run(4, PLAN4)


@pytest.fixture(scope="module")
def w1() -> dict[str, list[CellResult]]:
    return _run(1, PLAN1)


# ------------------------------------------------------------------------------------------
# Independent expectations
# ------------------------------------------------------------------------------------------


def is_moe(spec: ModelSpec, i: int) -> bool:
    f = spec.moe_layer_freq
    return (i % f == 0) if isinstance(f, int) else f[i] == 1


def stage_layers(spec: ModelSpec, lay: Layout, pp_rank: int) -> list[list[int]]:
    """Global decoder layer ids per model chunk of ``pp_rank`` (ParallelLayout's rules, docs/architecture.md)."""
    n, pp = spec.num_layers, lay.pp
    if lay.vpp:
        per = n // (pp * lay.vpp)
        return [list(range((v * pp + pp_rank) * per, (v * pp + pp_rank + 1) * per))
                for v in range(lay.vpp)]
    first, last = spec.num_layers_in_first_pipeline_stage, spec.num_layers_in_last_pipeline_stage
    if pp == 1:
        sizes = [n]
    elif first is None and last is None:
        sizes = [n // pp] * pp
    else:
        f = first if first is not None else None
        l_ = last if last is not None else None
        middle = pp - 2
        rest = n - (f or 0) - (l_ or 0)
        k = (1 if f is None else 0) + (1 if l_ is None else 0) + middle
        even = rest // k if k else 0
        sizes = [f if f is not None else even] + [even] * middle + [l_ if l_ is not None else even]
    off = sum(sizes[:pp_rank])
    return [list(range(off, off + sizes[pp_rank]))]


def expected_routers(spec: ModelSpec, lay: Layout, pp_rank: int) -> list[tuple[int, int, bool]]:
    out = [(c, i, False) for c, ids in enumerate(stage_layers(spec, lay, pp_rank))
           for i in ids if is_moe(spec, i)]
    if spec.mtp_num_layers and pp_rank == lay.pp - 1:
        last_chunk = (lay.vpp or 1) - 1
        out += [(last_chunk, mtp_router_id(spec, k), True) for k in range(spec.mtp_num_layers)]
    return out


def mtp_router_id(spec: ModelSpec, k: int) -> int:
    """``layer_number - 1`` of the k-th MTP layer's router, per megatron-core release."""
    import inspect

    from megatron.core.transformer.transformer_layer import TransformerLayer

    if "is_mtp_layer" in inspect.signature(TransformerLayer.__init__).parameters:
        # 0.17+: MTP layers are built with is_mtp_layer=True and number themselves from 1, so
        # their router ids alias decoder layers 0, 1, ... (why discovery never matches by id)
        return k
    # 0.16: the MTP layer's TransformerLayer gets layer_number = num_layers + k + 1
    return spec.num_layers + k


def expected_rows(res: CellResult, mb: int) -> int:
    lay, c = res.layout, res.coords
    return router_row_index(res.micro_batches[mb], tp=lay.tp, cp=lay.cp, tp_rank=c["tp_rank"],
                            cp_rank=c["cp_rank"], sequence_parallel=res.sequence_parallel).numel()


def check_cell(results: list[CellResult], spec: ModelSpec, *, recompute: bool = False) -> None:
    lay = results[0].layout
    assert len(results) == lay.tp * lay.cp * lay.pp * lay.dp(len(results)) == len(results)
    for res in results:
        want = expected_routers(spec, lay, res.coords["pp_rank"])
        assert res.routers == want, (res.name, res.rank)
        keys = {(c, i, m) for c, i, m in want}
        for phase in (res.fwd0, res.fwd1):
            # Forward-only: each router once per micro-batch, under no_grad, in mb order.
            assert sorted((r.chunk, r.layer_id, r.mtp, r.micro_batch) for r in phase) == sorted(
                (c, i, m, mb) for c, i, m in keys for mb in range(M))
            assert not any(r.grad_enabled for r in phase)
            for r in phase:
                assert r.num_rows == expected_rows(res, r.micro_batch), (res.name, r)
        grads = [r for r in res.train if r.grad_enabled]
        nograd = [r for r in res.train if not r.grad_enabled]
        assert sorted((r.chunk, r.layer_id, r.mtp, r.micro_batch) for r in grads) == sorted(
            (c, i, m, mb) for c, i, m in keys for mb in range(M))
        if recompute:
            # Checkpointed first pass under no_grad, then the recompute under grad, per mb.
            assert sorted((r.chunk, r.layer_id, r.mtp, r.micro_batch) for r in nograd) == sorted(
                (c, i, m, mb) for c, i, m in keys for mb in range(M))
            pos = {(r.chunk, r.layer_id, r.grad_enabled, r.micro_batch): n
                   for n, r in enumerate(res.train)}
            for c, i, _ in keys:
                for mb in range(M):
                    assert pos[(c, i, False, mb)] < pos[(c, i, True, mb)]
        else:
            assert nograd == []
        for r in res.train:
            assert r.num_rows == expected_rows(res, r.micro_batch)
        last = res.coords["pp_rank"] == lay.pp - 1
        for losses in (res.train_losses, res.fwd0_losses, res.fwd1_losses):
            assert len(losses) == (M if last else 0)
            assert all(math.isfinite(x) for x in losses)
        assert res.params_without_grad == [], res.params_without_grad
        assert res.grads_finite


# ------------------------------------------------------------------------------------------
# Layout cells
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,spec,recompute", [
    ("ref_real", SPEC_REAL, False),
    ("ref_mtp", SPEC_MTP, False),
    ("tp2", SPEC_REAL, False),
    ("tp2_etp2", SPEC_REAL, False),
    ("cp2", SPEC_IDENT, False),
    ("pp2", SPEC_REAL, False),
    ("pp2_vpp2", SPEC_REAL, False),
    ("ep2", SPEC_REAL, False),
    ("ep2_alltoall", SPEC_A2A, False),
    ("pp2_uneven_dense_first", SPEC_UNEVEN, False),
    ("pp2_freq2", SPEC_FREQ2, False),
    ("pp2_mtp", SPEC_MTP, False),
    ("pp2_full_recompute", SPEC_FULL, True),
    ("pp2_full_recompute_aux", SPEC_FULL_AUX, True),
    ("pp2_mtp_full_recompute", SPEC_MTP_FULL, True),
    ("pp2_moe_recompute", SPEC_MOE_RC, True),
    ("pp2_alltoall_varlen", SPEC_A2A_AUX, False),
])
def test_cell_two_ranks(w2: dict[str, list[CellResult]], name: str, spec: ModelSpec,
                        recompute: bool) -> None:
    check_cell(w2[name], spec, recompute=recompute)


@pytest.mark.parametrize("name,spec", [("tp2_ep2", SPEC_REAL), ("tp2_cp2", SPEC_IDENT)])
def test_cell_four_ranks(w4: dict[str, list[CellResult]], name: str, spec: ModelSpec) -> None:
    check_cell(w4[name], spec)


def test_uneven_stage_without_router(w2: dict[str, list[CellResult]]) -> None:
    by_stage = {r.coords["pp_rank"]: r for r in w2["pp2_uneven_dense_first"]}
    assert by_stage[0].routers == [] and by_stage[0].train == []
    assert [i for _, i, _ in by_stage[1].routers] == [1, 2, 3, 4, 5]


def test_variable_lengths_reach_routers(w2: dict[str, list[CellResult]]) -> None:
    res = w2["pp2_alltoall_varlen"][0]
    totals = [b.total for b in res.micro_batches]
    assert len(set(totals)) > 1  # no common padding: p2p exchanged shapes per micro-batch
    rows = sorted({(r.micro_batch, r.num_rows) for r in res.fwd0})
    assert [n for _, n in rows] == totals


def test_vpp_call_order(w2: dict[str, list[CellResult]]) -> None:
    """Interleaved schedule with M=3 (group size 3): chunk 0 runs all micro-batches first."""
    for res in w2["pp2_vpp2"]:
        order = [(r.chunk, r.micro_batch) for r in res.fwd0]
        assert order == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


# ------------------------------------------------------------------------------------------
# Same spec + seed -> same model in every layout
# ------------------------------------------------------------------------------------------


def _real_rows(x: torch.Tensor, batch: Any) -> dict[int, torch.Tensor]:
    keys = real_token_positions(batch)
    return {int(k): x[i] for i, k in enumerate(keys.tolist()) if k >= 0}


def _stack(d: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.stack([d[k] for k in sorted(d)])


def check_same_as_reference(ref: list[CellResult], par: list[CellResult]) -> None:
    ref0 = ref[0]
    lay = par[0].layout
    last = [r for r in par if r.coords["pp_rank"] == lay.pp - 1]
    assert last
    for res in last:
        for phase in ("fwd0_logits", "fwd1_logits"):
            for mb in range(M):
                a = _stack(_real_rows(getattr(ref0, phase)[mb], ref0.micro_batches[mb]))
                b = _stack(_real_rows(getattr(res, phase)[mb], res.micro_batches[mb]))
                torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4,
                                           msg=lambda m, where=f"{res.name} {phase} mb{mb}": f"{where}: {m}")
        assert res.train_losses == pytest.approx(ref0.train_losses, abs=1e-5, rel=1e-5)
    # Routing: every parallel router row, mapped to its packed token with router_row_index,
    # chose the same experts as the reference router of that layer for that token.
    ref_topk: dict[tuple[int, int, bool], dict[int, torch.Tensor]] = {}
    for r in ref0.fwd0:
        ref_topk[(r.micro_batch, r.layer_id, r.mtp)] = _real_rows(
            r.topk, ref0.micro_batches[r.micro_batch])
    checked = 0
    for res in par:
        c = res.coords
        for r in res.fwd0:
            batch = res.micro_batches[r.micro_batch]
            rows = router_row_index(batch, tp=lay.tp, cp=lay.cp, tp_rank=c["tp_rank"],
                                    cp_rank=c["cp_rank"], sequence_parallel=res.sequence_parallel)
            keys = real_token_positions(batch)[rows]
            want = ref_topk[(r.micro_batch, r.layer_id, r.mtp)]
            for row, key in enumerate(keys.tolist()):
                if key >= 0:
                    assert torch.equal(r.topk[row], want[key]), (res.name, r.layer_id, key)
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("name,ref", [
    ("tp2", "real"), ("tp2_etp2", "real"), ("pp2", "real"), ("pp2_vpp2", "real"), ("ep2", "real"),
    ("ep2_alltoall", "real"), ("cp2", "identity"), ("pp2_mtp", "mtp"),
    ("pp2_full_recompute", "real"), ("pp2_moe_recompute", "real"),
    ("tp2_loaded", "real"), ("pp2_vpp2_loaded", "real"), ("ep2_loaded", "real"),
])
def test_same_logits_and_routes_as_reference(w2: dict[str, list[CellResult]], name: str,
                                             ref: str) -> None:
    check_same_as_reference(w2[REFERENCE[ref]], w2[name])


@pytest.mark.parametrize("name,ref", [("tp2_ep2", "real"), ("tp2_cp2", "identity")])
def test_same_logits_four_ranks(w2: dict[str, list[CellResult]], w4: dict[str, list[CellResult]],
                                name: str, ref: str) -> None:
    check_same_as_reference(w2[REFERENCE[ref]], w4[name])


def test_world_size_one(w1: dict[str, list[CellResult]], w2: dict[str, list[CellResult]]) -> None:
    """spawn(world_size=1) works and equals the dp=2 reference run."""
    (res,) = w1["w1_real"]
    check_cell([res], SPEC_REAL)
    check_same_as_reference(w2["ref_real"], [res])


def test_other_seed_differs_until_loaded(w2: dict[str, list[CellResult]]) -> None:
    """Seed 999 alone gives another model; the *_loaded cells match the reference only
    because load_reference_state copied the TP=PP=1 model's canonical state in."""
    ref, other = w2["ref_real"][0], w2["tp2_other_seed"][0]
    a = _stack(_real_rows(ref.fwd0_logits[0], ref.micro_batches[0]))
    b = _stack(_real_rows(other.fwd0_logits[0], other.micro_batches[0]))
    assert (a - b).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------
# Data helpers and spawn plumbing (no model)
# ------------------------------------------------------------------------------------------


def test_zigzag_worked_example() -> None:
    """Field notes section 3: tp=2, cp=2, one sequence of 13 tokens."""
    b = make_packed_batch([13], vocab=50, seed=0, align=align_for(2, 2))
    assert b.padded_lens == [16]
    assert cp_zigzag_index(b.padded_lens, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_zigzag_index(b.padded_lens, 2, 1).tolist() == list(range(4, 12))
    got = {(c, t): router_row_index(b, tp=2, cp=2, tp_rank=t, cp_rank=c,
                                     sequence_parallel=True).tolist()
           for c in range(2) for t in range(2)}
    assert got == {(0, 0): [0, 1, 2, 3], (0, 1): [12, 13, 14, 15],
                   (1, 0): [4, 5, 6, 7], (1, 1): [8, 9, 10, 11]}


def test_zigzag_is_per_sequence() -> None:
    b = make_packed_batch([5, 3], vocab=50, seed=0, align=4)  # padded 8 + 4, cp=2 -> chunks 2, 1
    assert cp_zigzag_index(b.padded_lens, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_zigzag_index(b.padded_lens, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def _raise_on_rank1(ctx: dist.RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    return ctx.rank


def _sleep_forever(ctx: dist.RankContext) -> None:
    time.sleep(3600)


def test_rank_exception_propagates() -> None:
    with pytest.raises(dist.RankError) as info:
        dist.spawn(_raise_on_rank1, world_size=2, timeout=300)
    assert info.value.rank == 1
    assert "ValueError: boom from rank 1" in info.value.remote_traceback
    assert "_raise_on_rank1" in info.value.remote_traceback


def test_timeout_never_hangs() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        dist.spawn(_sleep_forever, world_size=1, timeout=3)
    assert time.monotonic() - t0 < 30
