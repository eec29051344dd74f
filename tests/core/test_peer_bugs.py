"""One test per bug the peers shipped (docs/architecture.md, "Findings worth knowing") that belongs to the core."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

import r3bridge
from r3bridge import ParallelLayout, ReplayBatch, RouteValueError, shard, stitch
from r3bridge.config import Action, phase_plan

from ._reference import megatron_parallel_state, random_routes, reference_rank_tags


# 8.3 -------------------------------------------------------------------------------------------
def test_zero_rows_are_never_replayed_as_expert_zero():
    """verl #4986 / miles #1002 / SkyRL #1908: rows without a route arrived as zero rows and were
    replayed as K copies of expert 0 (dispatcher split-size crash, skewed expert-bias counts)."""
    rng = np.random.default_rng(0)
    routes = random_routes(rng, 6, 2, 4, 16)
    routes[[1, 4]] = 0                                       # engine: no route for tokens 1 and 4
    valid = np.ones(6, dtype=bool)
    valid[[1, 4]] = False
    # marked valid, a zero row is refused ...
    with pytest.raises(RouteValueError, match="row 1 .*duplicate"):
        ReplayBatch.from_ragged([routes], num_experts=16, layer_ids=[0, 1])
    # ... marked invalid, it becomes a row of distinct fillers that is never replayed
    rb = ReplayBatch.from_ragged([routes], num_experts=16, layer_ids=[0, 1], valid=[valid])
    t = shard(rb, ParallelLayout(2, 1), [7])
    assert t.valid.tolist() == [True, False, True, True, False, True, False]
    for lid in (0, 1):
        for r in (1, 4, 6):
            row = t.indices[lid][r].tolist()
            assert row == [0, 1, 2, 3] and len(set(row)) == 4   # distinct, in range
        # every row of the target is a legal top-k row: K distinct ids (no dispatcher crash)
        assert all(len(set(x)) == 4 for x in t.indices[lid].tolist())


# 8.4 -------------------------------------------------------------------------------------------
def test_dense_layers_do_not_shift_moe_layer_indices():
    """verl #5037: engines report every layer (dense ones as zero rows); mapping the k-th MoE
    router to reported layer ``k + offset`` shifts every layer after a dense one."""
    rng = np.random.default_rng(1)
    freq = [0, 1, 0, 1, 1, 1]                                # dense layers 0 and 2
    reported = random_routes(rng, 9, 6, 2, 8)
    reported[:, [0, 2]] = 0
    moe = ParallelLayout(6, freq).moe_layer_ids
    assert moe == [1, 3, 4, 5]
    rb = ReplayBatch.from_vllm([reported], num_experts=8, moe_layer_ids=moe)
    lay = ParallelLayout(6, freq, pp=2)
    t0, t1 = shard(rb, lay, [10], pp_rank=0), shard(rb, lay, [10], pp_rank=1)
    assert list(t0.indices) == [1] and list(t1.indices) == [3, 4, 5]
    for lid, t in ((1, t0), (3, t1), (4, t1), (5, t1)):
        assert np.array_equal(t.indices[lid][:9].numpy(), reported[:, lid])
    # the buggy mapping (k-th MoE router <- k-th reported layer) reads other columns, among them
    # the zero rows of dense layers 0 and 2
    for k, lid in enumerate(moe):
        t = t0 if lid in t0.indices else t1
        assert not np.array_equal(t.indices[lid][:9].numpy(), reported[:, k])


def test_int_moe_layer_freq_is_not_off_by_one():
    """AReaL #1496 mapped int N to layers N-1, 2N-1, ...: megatron's rule is i % N == 0."""
    assert ParallelLayout(6, 2).moe_layer_ids == [0, 2, 4]
    assert ParallelLayout(6, 2).moe_layer_ids != [1, 3, 5]
    assert ParallelLayout(9, 3).moe_layer_ids == [0, 3, 6]


# 8.7 -------------------------------------------------------------------------------------------
def test_multi_turn_prefill_does_not_overwrite_sampling_routes():
    """miles #3307: a later turn's prefill re-routes earlier tokens; the routes that sampled
    those tokens are the first-seen ones. verl #5368 dropped them altogether."""
    rng = np.random.default_rng(2)
    decode = random_routes(rng, 6, 1, 2, 8)
    prefill = np.concatenate([(decode + 1) % 8, random_routes(rng, 4, 1, 2, 8)])   # all 6 re-routed
    a = ReplayBatch.from_ragged([decode], num_experts=8, layer_ids=[0])
    b = ReplayBatch.from_ragged([prefill], num_experts=8, layer_ids=[0])
    out, rep = stitch([a, b])
    assert np.array_equal(out.routes.numpy()[:6], decode)
    assert np.array_equal(out.routes.numpy()[6:], prefill[6:])
    assert rep.disagreeing_rows == [6]


def test_resubmit_is_deduplicated_not_concatenated():
    """AReaL #1207: abort/resubmit returned the whole prefix again and it was appended (~2.4% of
    samples zeroed)."""
    rng = np.random.default_rng(3)
    first = random_routes(rng, 5, 1, 2, 8)
    resubmitted = np.concatenate([first, random_routes(rng, 3, 1, 2, 8)])
    out, rep = stitch([ReplayBatch.from_ragged([first], num_experts=8, layer_ids=[0]),
                       ReplayBatch.from_ragged([resubmitted], num_experts=8, layer_ids=[0])])
    assert out.rows_per_seq == [8] and np.array_equal(out.routes.numpy(), resubmitted)
    assert rep.overlap_rows == [5] and rep.disagreeing_rows == [0]


# 8.8 -------------------------------------------------------------------------------------------
def test_r2_never_replays_rollout_routes():
    """verl 0.9.1: R2 combined with rollout routes silently replayed the rollout routes."""
    assert phase_plan("R2", "compute_log_prob").action is Action.RECORD
    assert phase_plan("R2", "update").route_kind == "recorded"
    assert phase_plan("R3", "update").route_kind == "rollout"


# 8.9 -------------------------------------------------------------------------------------------
def test_whole_tensor_zigzag_on_packed_batch_differs_and_ours_is_per_sequence():
    """miles #774 applied megatron's BSHD ``get_batch_on_this_cp_rank`` (one zigzag over the
    whole packed tensor) to a THD batch of several sequences. On a 2-sequence batch that places
    different tokens than the per-sequence zigzag the THD attention kernel uses."""
    import verl.models.mcore.util as vu
    from megatron.core.utils import get_batch_on_this_cp_rank
    cp, seq_lens = 2, [8, 16]
    tags = torch.cat([torch.arange(n) + 1 + 100 * i for i, n in enumerate(seq_lens)])   # padded already
    arrays = [np.stack([[[p % 8, (p + 1) % 8]] for p in range(n)]) for n in seq_lens]
    rb = ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0])
    for cp_rank in range(cp):
        with megatron_parallel_state(cp=cp, cp_rank=cp_rank):
            whole = get_batch_on_this_cp_rank({"tokens": tags[None].clone()})["tokens"][0]
            nested = torch.nested.nested_tensor_from_jagged(tags, offsets=torch.tensor([0, 8, 24]))
            per_seq = vu.preprocess_thd_engine(nested, pre_process=True)[0][0]
        assert whole.tolist() != per_seq.tolist()
        ref = reference_rank_tags(seq_lens, tp=1, cp=cp, sp=False, tp_rank=0, cp_rank=cp_rank)
        assert per_seq.tolist() == [1 + 100 * i + p for i, p in ref]
        t = shard(rb, ParallelLayout(1, 1, cp=cp), seq_lens, cp_rank=cp_rank)
        got_pos = t.indices[0][:, 0].tolist()
        assert got_pos == [p % 8 for _, p in ref]
        assert got_pos != [(x - 1) % 100 % 8 for x in whole.tolist()]


# 8.10 ------------------------------------------------------------------------------------------
def test_transport_is_compact_and_ragged_not_dense_padded():
    """verl #6211: dense padded [bs, P+R, L, K] int16/int32 caused timeouts."""
    rng = np.random.default_rng(4)
    lens = [100, 900, 250, 40]
    L, K, E = 12, 8, 128
    rb = ReplayBatch.from_ragged([random_routes(rng, n, L, K, E) for n in lens], num_experts=E,
                                 layer_ids=list(range(L)))
    dense_int16 = len(lens) * max(lens) * L * K * 2
    sglang_int32 = sum(lens) * L * K * 4
    assert rb.nbytes < sglang_int32 / 3.9                    # uint8 vs int32
    assert rb.nbytes < dense_int16 / 5                       # ragged uint8 vs padded int16
    assert b"\x80\x04\x95" not in rb.to_bytes()[:3]          # not a pickle stream


# 8.11 ------------------------------------------------------------------------------------------
def test_routes_travel_with_samples_through_repartitioning():
    """SkyRL #1908: dynamic sampling / micro-batch re-partitioning detached samples from routes."""
    rng = np.random.default_rng(5)
    arrays = [random_routes(rng, n, 1, 2, 64) for n in (3, 5, 2, 4)]
    rb = ReplayBatch.from_ragged(arrays, num_experts=64, layer_ids=[0], policy_versions=[0, 1, 2, 3])
    kept = [3, 0, 2]                                          # a filter dropped sample 1, order shuffled
    mb = rb.select(kept)
    for j, i in enumerate(kept):
        assert np.array_equal(mb.sequence(j)[0].numpy(), arrays[i])
    assert mb.policy_versions == kept


# vLLM / SGLang formats -------------------------------------------------------------------------
def test_read_only_vllm_arrays_and_uint16_above_256_experts():
    rng = np.random.default_rng(6)
    a = random_routes(rng, 7, 3, 8, 512).astype(np.uint16)
    a.flags.writeable = False
    rb = ReplayBatch.from_vllm([a], num_experts=512)
    assert rb.routes.dtype == torch.int16
    assert np.array_equal(rb.routes.numpy().astype(np.int64), a.astype(np.int64))
    assert not np.shares_memory(rb.routes.numpy(), a)


def test_sglang_row_count_is_prompt_plus_completion_minus_one():
    flat = np.tile(np.arange(2, dtype=np.int32), 4 * 3)      # 4 rows, 3 layers, top-2
    meta = {"routed_experts": base64.b64encode(flat.tobytes()), "prompt_tokens": 3, "completion_tokens": 2}
    rb = ReplayBatch.from_sglang([meta], num_experts=4, num_layers=3, topk=2)
    assert rb.rows_per_seq == [4]
    rb.check_seq_lens([5])
    with pytest.raises(r3bridge.PayloadError, match="expected 5"):
        ReplayBatch.from_sglang([dict(meta, completion_tokens=3)], num_experts=4, num_layers=3, topk=2)
