"""`shard` / `unshard`: every row of every rank's target is the route of the token Megatron places
there, checked against (a) megatron-core's and verl's own split/pack functions run on tag tensors
and (b) the per-sequence Python reference in ``_reference.py``; and ``unshard(shard(x)) == x``."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import r3bridge
from r3bridge import LayoutError, ParallelLayout, ReplayBatch, shard, unshard
from r3bridge.parallel.packing import PackPlan

from ._reference import (
    expected_from_tags,
    megatron_parallel_state,
    megatron_sp_scatter,
    reference_bshd_tags,
    reference_padded_lens,
    reference_rank_tags,
    tag_route,
    tag_routes,
)
from .strategies import batches, layouts

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _zeros(rows, layers=1):
    """Top-1 routes to expert 0 (a valid route)."""
    return np.zeros((rows, layers, 1), dtype=np.int64)


def _all_ranks(layout: ParallelLayout):
    for pp in range(layout.pp):
        for vp in range(layout.vp_size):
            for cp in range(layout.cp):
                for tp in range(layout.tp):
                    yield tp, cp, pp, vp


# ------------------------------------------------------------------------------ worked example
def test_worked_example_tp2_cp2_one_13_token_sequence():
    """TP2 x CP2, one 13-token sequence: align 8 -> 16 tokens, chunks C0..C3 of 4."""
    E = 64
    routes = [np.array([[[t, t + 20]] for t in range(13)])]       # token t routes to {t, t+20}
    rb = ReplayBatch.from_ragged(routes, num_experts=E, layer_ids=[0])
    lay = ParallelLayout(1, 1, tp=2, cp=2)
    expected_pos = {(0, 0): [0, 1, 2, 3], (0, 1): [12, 13, 14, 15],
                    (1, 0): [4, 5, 6, 7], (1, 1): [8, 9, 10, 11]}
    for (cp_rank, tp_rank), positions in expected_pos.items():
        t = shard(rb, lay, [13], tp_rank=tp_rank, cp_rank=cp_rank)
        valid = [p < 13 for p in positions]
        assert t.valid.tolist() == valid
        want = [[p, p + 20] if p < 13 else [0, 1] for p in positions]   # padding: fillers 0..K-1
        assert t.indices[0].tolist() == want
        seq, pos = r3bridge.rank_positions(PackPlan.build(lay, [13]), lay, tp_rank, cp_rank)
        assert pos.tolist() == positions and seq.tolist() == [0] * 4


def test_filler_rows_are_distinct_and_in_range_for_top8():
    # routes: every real token routes to experts 7..0 (reversed), so a filler (0..7) differs
    rb = ReplayBatch.from_ragged([np.tile(np.arange(8)[::-1], (5, 1, 1))], num_experts=8, layer_ids=[0])
    lay = ParallelLayout(1, 1, tp=4)                    # 5 tokens padded to 8, 2 rows per rank
    got = [shard(rb, lay, [5], tp_rank=r) for r in range(4)]
    assert [t.valid.tolist() for t in got] == [[True, True], [True, True], [True, False], [False, False]]
    assert got[2].indices[0][0].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    for t, r in ((got[2], 1), (got[3], 0), (got[3], 1)):
        assert t.indices[0][r].tolist() == list(range(8))


# ------------------------------------------------------------------------------ property tests
@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_unshard_of_compact_views_into_one_gathered_buffer(data):
    """What the R2 recorder hands to unshard: compact (uint8/int16/int32) per-layer targets that
    are views at arbitrary offsets of one flat gathered buffer (later micro-batches, later ranks).
    A view that starts mid-word once crashed the word-sized scatter for int16/int32 ids."""
    lay = data.draw(layouts(max_pp=2), label="layout")
    E, K = data.draw(st.sampled_from([(64, 3), (384, 4), (384, 10), (40000, 2)]), label="(E, K)")
    lens = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=4), label="seq_lens")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    L = len(lay.moe_layer_ids)
    rb = ReplayBatch.from_ragged([np.argsort(rng.random((n, L, E)), -1)[..., :K] for n in lens],
                                 num_experts=E, layer_ids=lay.moe_layer_ids, route_kind="recorded")
    lead = data.draw(st.integers(0, 9), label="ids before ours")
    pieces, sharded = [torch.zeros(lead, dtype=rb.routes.dtype)], []
    for key in _all_ranks(lay):
        t = shard(rb, lay, lens, tp_rank=key[0], cp_rank=key[1], pp_rank=key[2], vp_stage=key[3])
        pieces += [t.indices[lid].to(rb.routes.dtype).reshape(-1) for lid in t.layer_ids]
        sharded.append((key, t))
    buf, off, targets = torch.cat(pieces), lead, {}
    for key, t in sharded:
        ind = {}
        for lid in t.layer_ids:
            ind[lid] = buf[off:off + t.num_rows * K].view(t.num_rows, K)
            off += t.num_rows * K
        targets[key] = r3bridge.ShardedTargets(ind, t.valid, t.layer_ids, K)
    assert unshard(targets, lay, lens, num_experts=E).equals(rb)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_every_rank_row_is_the_route_megatron_places_there_and_unshard_inverts(data):
    lay = data.draw(layouts(allow_fp8=True), label="layout")
    b = data.draw(batches(lay.moe_layer_ids), label="batch")
    targets = {}
    expected = {}
    for tp, cp, pp, vp in _all_ranks(lay):
        t = shard(b.rb, lay, b.seq_lens, tp_rank=tp, cp_rank=cp, pp_rank=pp, vp_stage=vp)
        if (tp, cp) not in expected:        # rows are the same on every pipeline stage
            tags = reference_rank_tags(b.seq_lens, tp=lay.tp, cp=lay.cp, sp=bool(lay.sequence_parallel),
                                       tp_rank=tp, cp_rank=cp, fp8=lay.fp8)
            expected[(tp, cp)] = expected_from_tags(
                tags, starts=b.starts, rows=b.rows, invalid=b.invalid, seq_lens=b.seq_lens,
                layer_ids=lay.moe_layer_ids, topk=b.topk, num_experts=b.num_experts)
        exp, exp_valid = expected[(tp, cp)]
        stage_layers = lay.moe_layers(pp, vp)
        assert t.layer_ids == tuple(stage_layers)
        assert list(t.indices) == stage_layers
        assert np.array_equal(t.valid.numpy(), exp_valid)
        for lid in stage_layers:
            assert t.indices[lid].dtype == torch.int64
            assert np.array_equal(t.indices[lid].numpy(), exp[lid]), f"layer {lid}"
        targets[(tp, cp, pp, vp)] = t
    back = unshard(targets, lay, b.seq_lens, num_experts=b.num_experts,
                   start_rows=b.rb.start_rows, rows_per_seq=b.rb.rows_per_seq)
    assert back.equals(b.rb)
    # every MoE layer lives on exactly one (pp, vp) stage
    owned = sorted(l for pp in range(lay.pp) for vp in range(lay.vp_size) for l in lay.moe_layers(pp, vp))
    assert owned == lay.moe_layer_ids


def test_every_rank_row_is_the_route_megatron_places_there_by_run_copies():
    """The same check with every host read taking the run copy (one strided copy per run of
    consecutive source rows), however short the runs: both gathers give the same targets."""
    from unittest import mock

    from r3bridge.parallel import gather

    with mock.patch.object(gather, "RUN_COPY_MIN_ROWS", 1):
        test_every_rank_row_is_the_route_megatron_places_there_and_unshard_inverts()


def _expected_from_packed_tags(rows, b, P, layer_ids):
    """Expected (indices per layer, valid) for rows holding ``1 + P*seq + pos`` tags (0: pad)."""
    T = len(rows)
    valid = np.zeros(T, dtype=bool)
    exp = {lid: np.tile(np.arange(b.topk), (T, 1)) for lid in layer_ids}
    for r, tag in enumerate(rows):
        if tag == 0:
            continue
        i, p = (tag - 1) // P, (tag - 1) % P
        if b.starts[i] <= p < b.starts[i] + b.rows[i] and (i, p) not in b.invalid:
            valid[r] = True
            for lid in layer_ids:
                exp[lid][r] = tag_route(i, p, lid, b.topk, b.num_experts)
    return exp, valid


@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_thd_matches_verl_thd_engine_packer_and_megatron_sp_split(data):
    """verl 0.9.1 ``preprocess_thd_engine`` (per-sequence zigzag, its own alignment/FP8 rules)
    packs a tag tensor; megatron-core's ``scatter_to_sequence_parallel_region`` splits it. Our
    target must hold, row by row, the route of the tag verl put there."""
    import verl.models.mcore.util as vu
    tp = data.draw(st.sampled_from([1, 2, 4]))
    cp = data.draw(st.sampled_from([1, 2, 4]))
    fp8 = tp * cp <= 4 and data.draw(st.booleans())
    lay = ParallelLayout(2, 1, tp=tp, cp=cp, fp8=fp8)
    b = data.draw(batches([0, 1], max_len=30))
    P = 1000
    tags = torch.cat([torch.arange(n, dtype=torch.int64) + 1 + P * i for i, n in enumerate(b.seq_lens)])
    offsets = torch.tensor([0] + list(np.cumsum(b.seq_lens)), dtype=torch.int64)
    nested = torch.nested.nested_tensor_from_jagged(tags, offsets=offsets)
    for cp_rank in range(cp):
        with megatron_parallel_state(tp=tp, cp=cp, cp_rank=cp_rank):
            packed, psp, _ = vu.preprocess_thd_engine(nested, pre_process=True, use_fp8_padding=fp8)
        packed = packed.squeeze(0)
        for tp_rank in range(tp):
            rows = megatron_sp_scatter(packed, tp, tp_rank) if tp > 1 else packed
            t = shard(b.rb, lay, b.seq_lens, tp_rank=tp_rank, cp_rank=cp_rank)
            assert t.num_rows == rows.numel()
            exp, valid = _expected_from_packed_tags(rows.tolist(), b, P, (0, 1))
            assert np.array_equal(t.valid.numpy(), valid)
            for lid in (0, 1):
                assert np.array_equal(t.indices[lid].numpy(), exp[lid])
        # the plan's padded lengths are verl's cu_seqlens_padded, including FP8's total pad
        cu = psp.cu_seqlens_q_padded.to(torch.int64)
        assert PackPlan.build(lay, b.seq_lens).padded_lens.tolist() == (cu[1:] - cu[:-1]).tolist()


@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_thd_matches_verl_preprocess_packed_seqs_with_left_and_right_padding(data):
    """verl's older BSHD->THD packer (``preprocess_packed_seqs``) from a padded tag batch."""
    import verl.models.mcore.util as vu
    tp = data.draw(st.sampled_from([1, 2]))
    cp = data.draw(st.sampled_from([1, 2]))
    lay = ParallelLayout(1, 1, tp=tp, cp=cp)
    b = data.draw(batches([0], max_len=20))
    S = max(b.seq_lens) + data.draw(st.integers(0, 3))
    left = data.draw(st.booleans())
    ids = torch.zeros(len(b.seq_lens), S, dtype=torch.int64)
    mask = torch.zeros(len(b.seq_lens), S, dtype=torch.bool)
    for i, n in enumerate(b.seq_lens):
        sl = slice(S - n, S) if left else slice(0, n)
        ids[i, sl] = torch.arange(n) + 1 + 1000 * i
        mask[i, sl] = True
    for cp_rank in range(cp):
        with megatron_parallel_state(tp=tp, cp=cp, cp_rank=cp_rank):
            packed, _ = vu.preprocess_packed_seqs(ids, mask, pre_process=True)
        packed = packed.squeeze(0)
        for tp_rank in range(tp):
            rows = megatron_sp_scatter(packed, tp, tp_rank) if tp > 1 else packed
            t = shard(b.rb, lay, b.seq_lens, tp_rank=tp_rank, cp_rank=cp_rank)
            exp, valid = _expected_from_packed_tags(rows.tolist(), b, 1000, (0,))
            assert np.array_equal(t.valid.numpy(), valid)
            assert np.array_equal(t.indices[0].numpy(), exp[0])


@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_bshd_matches_megatron_get_batch_on_this_cp_rank_and_sp_scatter(data):
    """BSHD: megatron-core's own ``get_batch_on_this_cp_rank`` zigzags the whole sequence dim;
    the embedding output is [s, b, h] and SP splits s; router rows are ``s * b + b_idx``."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    tp = data.draw(st.sampled_from([1, 2, 4]))
    cp = data.draw(st.sampled_from([1, 2, 4]))
    sp = tp > 1 and data.draw(st.booleans())
    lay = ParallelLayout(1, 1, tp=tp, cp=cp, sequence_parallel=sp)
    b = data.draw(batches([0], max_len=24))
    unit = math.lcm(2 * cp if cp > 1 else 1, cp * (tp if sp else 1))
    S = -(-max(b.seq_lens) // unit) * unit + unit * data.draw(st.integers(0, 1))
    B = len(b.seq_lens)
    tags = torch.zeros(B, S, dtype=torch.int64)
    for i, n in enumerate(b.seq_lens):
        tags[i, :n] = torch.arange(n) + 1 + 1000 * i
    for cp_rank in range(cp):
        with megatron_parallel_state(tp=tp, cp=cp, cp_rank=cp_rank):
            local = get_batch_on_this_cp_rank({"tokens": tags.clone()})["tokens"]   # [B, S/cp]
        sbh = local.t().contiguous()                                               # [S/cp, B]
        for tp_rank in range(tp):
            part = megatron_sp_scatter(sbh, tp, tp_rank) if sp else sbh
            rows = part.reshape(-1).tolist()                                       # s-major
            t = shard(b.rb, lay, b.seq_lens, tp_rank=tp_rank, cp_rank=cp_rank, format="bshd",
                      seq_length=S)
            ref = reference_bshd_tags(B, S, tp=tp, cp=cp, sp=sp, tp_rank=tp_rank, cp_rank=cp_rank)
            assert len(rows) == len(ref) == t.num_rows
            for r, tag in enumerate(rows):
                bi, p = ref[r]
                if tag == 0:
                    assert p >= b.seq_lens[bi] and not bool(t.valid[r])
                    continue
                assert ((tag - 1) // 1000, (tag - 1) % 1000) == (bi, p)
                covered = b.starts[bi] <= p < b.starts[bi] + b.rows[bi] and (bi, p) not in b.invalid
                assert bool(t.valid[r]) == covered
                if covered:
                    assert t.indices[0][r].tolist() == tag_route(bi, p, 0, b.topk, b.num_experts)


@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_bshd_unshard_inverts_shard(data):
    lay = data.draw(layouts(max_pp=2))
    b = data.draw(batches(lay.moe_layer_ids, max_len=16))
    unit = math.lcm(2 * lay.cp if lay.cp > 1 else 1, lay.cp * lay.sp_split)
    S = -(-max(b.seq_lens) // unit) * unit
    targets = {k: shard(b.rb, lay, b.seq_lens, tp_rank=k[0], cp_rank=k[1], pp_rank=k[2], vp_stage=k[3],
                        format="bshd", seq_length=S) for k in _all_ranks(lay)}
    back = unshard(targets, lay, b.seq_lens, num_experts=b.num_experts, format="bshd", seq_length=S,
                   start_rows=b.rb.start_rows, rows_per_seq=b.rb.rows_per_seq)
    assert back.equals(b.rb)


# ------------------------------------------------------------------------------ FP8, cu_seqlens, BSHD
def test_fp8_alignment_per_sequence_lcm16_and_total_to_align_times_128():
    # tp=2, cp=1: align 2 -> per sequence lcm(16, 2) = 16, total to 2 * 128 = 256
    lay = ParallelLayout(1, 1, tp=2, fp8=True)
    plan = PackPlan.build(lay, [13, 30])
    assert plan.padded_lens.tolist() == [16, 256 - 16]
    # tp=2, cp=2: align 8 -> per sequence 16, total to 8 * 128 = 1024
    lay = ParallelLayout(1, 1, tp=2, cp=2, fp8=True)
    assert PackPlan.build(lay, [13, 17]).padded_lens.tolist() == [16, 1024 - 16]
    # tp=4, cp=4: align 32 -> per sequence 32, total to 4096
    lay = ParallelLayout(1, 1, tp=4, cp=4, fp8=True)
    assert PackPlan.build(lay, [33]).padded_lens.tolist() == [4096]
    assert reference_padded_lens([13, 30], 2, 1, fp8=True) == [16, 240]


def test_fp8_shard_places_rows_like_the_reference():
    lay = ParallelLayout(2, 1, tp=2, cp=2, fp8=True)
    seq_lens = [13, 30, 7]
    arrays = [tag_routes(i, 0, n - 1, [0, 1], 2, 64) for i, n in enumerate(seq_lens)]
    rb = ReplayBatch.from_ragged(arrays, num_experts=64, layer_ids=[0, 1])
    for cp in range(2):
        for tp in range(2):
            t = shard(rb, lay, seq_lens, tp_rank=tp, cp_rank=cp)
            tags = reference_rank_tags(seq_lens, tp=2, cp=2, sp=True, tp_rank=tp, cp_rank=cp, fp8=True)
            assert t.num_rows == 1024 // 4
            exp, v = expected_from_tags(tags, starts=[0] * 3, rows=[n - 1 for n in seq_lens], invalid=set(),
                                        seq_lens=seq_lens, layer_ids=[0, 1], topk=2, num_experts=64)
            assert t.valid.tolist() == v.tolist()
            assert np.array_equal(t.indices[1].numpy(), exp[1])


def test_cu_seqlens_padded_consistent_with_extra_padding_is_followed():
    """A trainer that pads more than the minimum (e.g. verl's ``pad_to_length_bucket`` /
    ``min_local_rows`` add rows to the last sequence) passes its real ``cu_seqlens_padded``."""
    lay = ParallelLayout(1, 1, tp=2, cp=2)
    seq_lens = [13, 5]
    rb = ReplayBatch.from_ragged([tag_routes(i, 0, n, [0], 2, 64) for i, n in enumerate(seq_lens)],
                                 num_experts=64, layer_ids=[0])
    default = [0, 16, 24]
    bigger = [0, 16, 40]          # last sequence padded to 24 instead of 8 (still divisible by 2cp)
    for cu, padded in ((default, [16, 8]), (bigger, [16, 24])):
        for cp in range(2):
            for tp in range(2):
                t = shard(rb, lay, seq_lens, tp_rank=tp, cp_rank=cp, cu_seqlens_padded=cu)
                tags = reference_rank_tags(seq_lens, tp=2, cp=2, sp=True, tp_rank=tp, cp_rank=cp,
                                           padded=padded)
                exp, v = expected_from_tags(tags, starts=[0, 0], rows=seq_lens, invalid=set(),
                                            seq_lens=seq_lens, layer_ids=[0], topk=2, num_experts=64)
                assert t.valid.tolist() == v.tolist()
                assert np.array_equal(t.indices[0].numpy(), exp[0])
    # the default cu_seqlens_padded gives exactly what no cu_seqlens_padded gives
    a = shard(rb, lay, seq_lens, tp_rank=1, cp_rank=1, cu_seqlens_padded=torch.tensor(default, dtype=torch.int32))
    b = shard(rb, lay, seq_lens, tp_rank=1, cp_rank=1)
    assert torch.equal(a.indices[0], b.indices[0]) and torch.equal(a.valid, b.valid)


@pytest.mark.parametrize("cu, why", [
    ([0, 16], "entries"),                 # wrong number of entries
    ([1, 17, 25], "[0, ...]"),            # does not start at 0
    ([0, 12, 20], "fewer than its seq_len"),   # 12 < 13 tokens
    ([0, 18, 26], "not divisible by 2*cp"),    # 18 % 4
    ([0, 16, 28], "packed length"),            # (16 + 12) / cp = 14 rows, not divisible by tp=4
])
def test_cu_seqlens_padded_inconsistent_raises_layout_error(cu, why):
    lay = ParallelLayout(1, 1, tp=4, cp=2)
    rb = ReplayBatch.from_ragged([_zeros(13), _zeros(5)], num_experts=4, layer_ids=[0])
    with pytest.raises(LayoutError, match=re.escape(why)):
        shard(rb, lay, [13, 5], cu_seqlens_padded=cu)


def test_bshd_accepts_megatron_valid_lengths_and_rejects_others():
    lay = ParallelLayout(1, 1, tp=2, cp=2)
    rb = ReplayBatch.from_ragged([_zeros(10)], num_experts=4, layer_ids=[0])
    # s=12: 2cp=4 divides 12 and s/cp = 6 divides over tp=2 -> valid in megatron
    t = shard(rb, lay, [10], format="bshd", seq_length=12)
    assert t.num_rows == 3
    with pytest.raises(LayoutError, match="seq_length 10"):
        shard(rb, lay, [10], format="bshd", seq_length=10)        # 10 % 4 != 0
    with pytest.raises(r3bridge.CoverageError, match="sequence 0"):
        shard(rb, lay, [10], format="bshd", seq_length=8)         # sequence longer than s
    with pytest.raises(LayoutError, match="format"):
        shard(rb, lay, [10], format="sbhd")


def test_shard_raises_when_batch_lacks_a_stage_moe_layer():
    lay = ParallelLayout(4, 1, pp=2)
    rb = ReplayBatch.from_ragged([_zeros(5, 2)], num_experts=4, layer_ids=[0, 1])
    shard(rb, lay, [5], pp_rank=0)
    with pytest.raises(r3bridge.LayerMappingError, match=r"\[2, 3\]"):
        shard(rb, lay, [5], pp_rank=1)


def test_shard_on_a_dense_only_stage_gives_no_targets():
    lay = ParallelLayout(4, [0, 0, 1, 1], pp=2)
    rb = ReplayBatch.from_ragged([_zeros(5, 2)], num_experts=4, layer_ids=[2, 3])
    t = shard(rb, lay, [5], pp_rank=0)
    assert t.indices == {} and t.layer_ids == ()


def test_shard_rejects_rows_that_do_not_fit_seq_lens():
    rb = ReplayBatch.from_ragged([_zeros(5)], num_experts=4, layer_ids=[0])
    lay = ParallelLayout(1, 1)
    shard(rb, lay, [5])
    shard(rb, lay, [6])                      # last sampled token has no row
    for bad in ([4], [7]):
        with pytest.raises(r3bridge.CoverageError, match="sequence 0"):
            shard(rb, lay, bad)
    with pytest.raises(r3bridge.CoverageError, match="2 seq_lens"):
        shard(rb, lay, [5, 5])


def test_rank_out_of_range_raises():
    rb = ReplayBatch.from_ragged([_zeros(5)], num_experts=4, layer_ids=[0])
    lay = ParallelLayout(2, 1, tp=2, pp=2)
    for kw in (dict(tp_rank=2), dict(cp_rank=1), dict(pp_rank=2), dict(vp_stage=1)):
        with pytest.raises(LayoutError):
            shard(rb, lay, [5], **kw)


def test_unshard_detects_missing_stage_and_disagreeing_ranks():
    lay = ParallelLayout(2, 1, tp=2, pp=2, sequence_parallel=False)
    rb = ReplayBatch.from_ragged([tag_routes(0, 0, 6, [0, 1], 2, 64)], num_experts=64, layer_ids=[0, 1])
    ts = {(tp, 0, pp, 0): shard(rb, lay, [6], tp_rank=tp, pp_rank=pp) for tp in range(2) for pp in range(2)}
    assert unshard(ts, lay, [6], num_experts=64).equals(rb)
    partial = {k: v for k, v in ts.items() if k[2] == 0}
    with pytest.raises(r3bridge.LayerMappingError, match="layers"):
        unshard(partial, lay, [6], num_experts=64)
    bad = dict(ts)
    t = bad[(1, 0, 0, 0)]
    idx = {lid: x.clone() for lid, x in t.indices.items()}
    idx[0][2] = torch.tensor([5, 6])
    bad[(1, 0, 0, 0)] = r3bridge.ShardedTargets(idx, t.valid, t.layer_ids, t.topk)
    with pytest.raises(r3bridge.ReplayStateError, match="layer 0"):
        unshard(bad, lay, [6], num_experts=64)


# ------------------------------------------------------------------------------ gather fast path
@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_word_gather_equals_plain_gather(data):
    """``shard`` moves the K ids of a (row, layer) as machine words; whatever the dtype, top-k,
    column order, contiguity or storage offset, the result is the plain element gather."""
    from r3bridge.parallel.gather import _gather_layer_major

    dtype = data.draw(st.sampled_from([torch.uint8, torch.int16, torch.int32]))
    k = data.draw(st.integers(1, 9))
    L = data.draw(st.integers(1, 6))
    rows = data.draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    base = torch.randint(0, 100, (rows + 1, L, k), generator=g).to(dtype)
    kind = data.draw(st.sampled_from(["contiguous", "offset", "transposed"]))
    if kind == "offset":
        src = base.view(-1)[1:1 + rows * L * k].view(rows, L, k)      # storage offset of 1 element
    elif kind == "transposed":
        src = base[:rows].transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    else:
        src = base[:rows]
    row = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=30)))
    cols = data.draw(st.lists(st.integers(0, L - 1), min_size=1, max_size=L, unique=True))
    got = _gather_layer_major(src, row, cols)
    want = src[row][:, cols].permute(1, 0, 2)
    assert got.dtype == src.dtype and torch.equal(got, want)


@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_run_copy_equals_plain_gather(data):
    """On the host, read rows that come in runs of consecutive source rows are copied one run at a
    time (machine words where they fit); the covered rows are the plain element gather's, whatever
    the dtype, top-k, contiguity or storage offset, and the rows of uncovered runs are 0."""
    from r3bridge.parallel.gather import _copy_runs_layer_major

    dtype = data.draw(st.sampled_from([torch.uint8, torch.int16, torch.int32]))
    k = data.draw(st.integers(1, 9))
    L = data.draw(st.integers(1, 6))
    rows = data.draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    base = torch.randint(0, 100, (rows + 1, L, k), generator=g).to(dtype)
    kind = data.draw(st.sampled_from(["contiguous", "offset", "transposed"]))
    if kind == "offset":
        src = base.view(-1)[1:1 + rows * L * k].view(rows, L, k)
    elif kind == "transposed":
        src = base[:rows].transpose(0, 1).contiguous().transpose(0, 1)
    else:
        src = base[:rows]
    runs = data.draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(1, 8), st.booleans()),
                              min_size=1, max_size=6))
    runs = [(f, min(n, rows - f), c) for f, n, c in runs]
    lens = np.array([n for _, n, _ in runs])
    run_end = np.cumsum(lens)
    run_start = run_end - lens
    covered = np.repeat([c for _, _, c in runs], lens)
    first = np.array([f for f, _, _ in runs])
    c0 = data.draw(st.integers(0, L - 1))
    cols = list(range(c0, data.draw(st.integers(c0 + 1, L))))
    got = _copy_runs_layer_major(src, first, run_start, run_end, covered, cols)
    row = torch.from_numpy(np.concatenate([np.arange(f, f + n) for f, n, _ in runs]))
    want = src[row][:, cols].permute(1, 0, 2)
    cov = torch.from_numpy(covered)
    assert got.dtype == src.dtype and got.shape == want.shape
    assert torch.equal(got[:, cov], want[:, cov]) and not got[:, ~cov].any()


def test_shard_with_unsorted_batch_layer_order_and_layer_override():
    layer_ids = [5, 1, 3, 0, 2, 4]
    arr = tag_routes(0, 0, 9, layer_ids, 8, 128)
    rb = ReplayBatch.from_ragged([arr], num_experts=128, layer_ids=layer_ids)
    lay = ParallelLayout(6, 1, pp=2)
    for pp, want in ((0, [0, 1, 2]), (1, [3, 4, 5])):
        t = shard(rb, lay, [10], pp_rank=pp)
        assert list(t.indices) == want
        for lid in want:
            assert np.array_equal(t.indices[lid][:9].numpy(), arr[:, layer_ids.index(lid)])
    t = shard(rb, lay, [10], layer_ids=[4, 0])
    assert list(t.indices) == [4, 0] and np.array_equal(t.indices[0][:9].numpy(), arr[:, 3])
