"""The rank-direct ingest (`r3bridge.rank_targets`) equals
``shard(ReplayBatch.from_vllm(...))`` on random shapes and layouts (CP, SP, PP, VPP, dense-first
layers, BSHD, partial coverage), and raises the same ReplayErrors for what the rank reads; the
one-pass whole-batch ingest still names sequence / row / layer of bad ids; a batch too large for
the host raises ReplayMemoryError naming its size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from r3bridge import ParallelLayout, ReplayBatch, rank_targets, shard
from r3bridge.engines.engine_pack import allocate
from r3bridge.engines.route_scan import duplicate_rows, row_faults, sorting_network
from r3bridge.errors import CoverageError, LayerMappingError, ReplayError, ReplayMemoryError, RouteValueError


def _engine_routes(rng, lens, num_layers, dense, topk, experts, dtype):
    """vLLM-like arrays ``[len - 1, num_layers, K]``, dense layers zero, read-only."""
    out = []
    for n in lens:
        a = np.zeros((max(n - 1, 0), num_layers, topk), dtype=dtype)
        for lid in range(num_layers):
            if lid in dense:
                continue
            a[:, lid] = np.argsort(rng.random((a.shape[0], experts)), axis=1)[:, :topk]
        a.flags.writeable = False
        out.append(a)
    return out


def _same(a, b):
    assert a.layer_ids == b.layer_ids and a.topk == b.topk and a.num_valid == b.num_valid
    assert torch.equal(a.valid, b.valid)
    for lid in a.layer_ids:
        assert a.indices[lid].dtype == torch.int64 and torch.equal(a.indices[lid], b.indices[lid])


LAYOUTS = [
    dict(num_layers=8, moe_layer_freq=1, tp=1, cp=1, pp=1),
    dict(num_layers=8, moe_layer_freq=(0, 0, 1, 1, 1, 1, 1, 1), tp=2, cp=2, pp=2),          # dense-first
    dict(num_layers=8, moe_layer_freq=2, tp=4, cp=2, pp=2, sequence_parallel=True),
    dict(num_layers=8, moe_layer_freq=(0, 1, 1, 1, 1, 1, 1, 1), tp=2, cp=1, pp=2, vpp=2),   # VPP
    dict(num_layers=6, moe_layer_freq=1, tp=2, cp=1, pp=3, sequence_parallel=False),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("spec", LAYOUTS)
def test_rank_targets_equal_shard_of_from_vllm(spec, seed):
    rng = np.random.default_rng(seed)
    lay = ParallelLayout(**spec)
    moe = lay.moe_layer_ids
    dense = set(range(lay.num_layers)) - set(moe)
    lens = rng.integers(1, 40, size=int(rng.integers(1, 6))).tolist()
    dtype = [np.uint8, np.int16, np.int32][seed]
    items = _engine_routes(rng, lens, lay.num_layers, dense, 3, 16, dtype)
    rb = ReplayBatch.from_vllm(items, num_experts=16, moe_layer_ids=moe)
    for pp in range(lay.pp):
        for vp in range(lay.vp_size):
            for cp in range(lay.cp):
                for tp in range(lay.tp):
                    want = shard(rb, lay, lens, tp_rank=tp, cp_rank=cp, pp_rank=pp, vp_stage=vp)
                    got = rank_targets(items, lay, lens, num_experts=16, moe_layer_ids=moe, tp_rank=tp,
                                       cp_rank=cp, pp_rank=pp, vp_stage=vp)
                    _same(got, want)


def test_rank_targets_partial_coverage_start_rows_and_bshd():
    rng = np.random.default_rng(7)
    lay = ParallelLayout(4, 1, tp=2, cp=2, pp=2, sequence_parallel=True)
    lens = [24, 16, 8]
    full = _engine_routes(rng, lens, 4, set(), 2, 8, np.uint8)
    starts = [3, 0, 5]
    items = [a[s:s + 10] for a, s in zip(full, starts)]         # routes of a later call, some short
    lens2 = [s + a.shape[0] + 1 for s, a in zip(starts, items)]
    rb = ReplayBatch.from_vllm(items, num_experts=8, start_rows=starts)
    for fmt, kw in (("thd", {}), ("bshd", {"seq_length": 24})):
        for cp in range(2):
            for tp in range(2):
                want = shard(rb, lay, lens2, tp_rank=tp, cp_rank=cp, pp_rank=1, format=fmt, **kw)
                got = rank_targets(items, lay, lens2, num_experts=8, start_rows=starts, tp_rank=tp, cp_rank=cp,
                                   pp_rank=1, format=fmt, **kw)
                _same(got, want)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])     # copied then checked / checked then narrowed
def test_rank_targets_names_bad_ids_it_reads_and_ignores_rows_it_does_not(dtype):
    rng = np.random.default_rng(1)
    lay = ParallelLayout(4, 1, tp=1, cp=2, pp=2)
    lens = [16, 16]
    items = [a.copy() for a in _engine_routes(rng, lens, 4, set(), 3, 8, dtype)]
    items[1][2, 3] = [5, 5, 1]                  # sequence 1, row 2, layer 3: duplicate
    # layer 3 is on pp rank 1; token 2 of a 16-token sequence is in CP rank 0's first chunk
    with pytest.raises(RouteValueError, match=r"sequence 1, row 2 \(token 2\), layer 3: duplicate expert ids \[5, 5, 1\]"):
        rank_targets(items, lay, lens, num_experts=8, pp_rank=1, cp_rank=0)
    with pytest.raises(RouteValueError, match=r"sequence 1, row 2 \(token 2\), layer 3: duplicate"):
        ReplayBatch.from_vllm(items, num_experts=8)
    rank_targets(items, lay, lens, num_experts=8, pp_rank=0, cp_rank=0)     # layers 0-1: not read here
    rank_targets(items, lay, lens, num_experts=8, pp_rank=1, cp_rank=1)     # tokens 4-11 only
    big = 300 if dtype == np.int16 else 200     # int16 300 would wrap to 44 in uint8
    items[0][9, 1] = [1, big, 2]
    msg = rf"sequence 0, row 9 \(token 9\), layer 1: expert ids \[1, {big}, 2\] out of range"
    with pytest.raises(RouteValueError, match=msg):
        rank_targets(items, lay, lens, num_experts=8, pp_rank=0, cp_rank=1)
    with pytest.raises(RouteValueError, match=msg):
        ReplayBatch.from_vllm(items, num_experts=8)


def test_rank_targets_refuses_what_shard_refuses():
    rng = np.random.default_rng(2)
    lay = ParallelLayout(4, 1, pp=2)
    items = _engine_routes(rng, [8, 8], 4, set(), 2, 8, np.uint8)
    with pytest.raises(CoverageError, match="sequence 1"):
        rank_targets(items, lay, [8, 12], num_experts=8)
    with pytest.raises(LayerMappingError, match="needs MoE layers"):
        rank_targets(items, lay, [8, 8], num_experts=8, moe_layer_ids=[0, 1], pp_rank=1)
    with pytest.raises(LayerMappingError, match="out of range"):
        rank_targets(items, lay, [8, 8], num_experts=8, moe_layer_ids=[0, 9])


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("topk", [1, 2, 5, 22])
def test_duplicate_scan_equals_a_row_sort(dtype, topk):
    rng = np.random.default_rng(topk)
    ids = rng.integers(0, 40, size=(3000, topk)).astype(dtype)
    s = np.sort(ids, axis=1)
    want = (s[:, 1:] == s[:, :-1]).any(1)
    assert want.any() or topk == 1
    assert np.array_equal(duplicate_rows(ids, 40), want)
    rng_bad, _ = row_faults(ids, 30)
    assert np.array_equal(rng_bad, (ids >= 30).any(1))


@pytest.mark.parametrize("k", range(1, 26))
def test_sorting_network_sorts_every_01_input(k):
    # 0-1 principle: a comparator network sorts every input iff it sorts every 0/1 input
    x = ((np.arange(1 << min(k, 16))[:, None] >> np.arange(k)) & 1).astype(np.uint8) if k <= 16 else \
        np.random.default_rng(k).integers(0, 2, size=(1 << 16, k)).astype(np.uint8)
    cols = list(x.T.copy())
    for i, j in sorting_network(k):
        cols[i], cols[j] = np.minimum(cols[i], cols[j]), np.maximum(cols[i], cols[j])
    s = np.stack(cols, 1)
    assert (np.diff(s.astype(np.int8), axis=1) >= 0).all()


def test_whole_batch_ingest_names_the_first_bad_row_with_the_batch_total():
    rng = np.random.default_rng(3)
    items = [a.copy() for a in _engine_routes(rng, [3000, 40, 3000], 3, {0}, 4, 16, np.uint8)]
    items[2][2500, 1] = [1, 2, 2, 3]
    items[2][2900, 2] = [7, 7, 7, 7]
    items[1][3, 2] = [0, 4, 9, 4]
    with pytest.raises(RouteValueError, match=r"sequence 1, row 3 \(token 3\), layer 2: duplicate expert ids "
                                              r"\[0, 4, 9, 4\].*3 bad \(row, layer\) pairs in total"):
        ReplayBatch.from_vllm(items, num_experts=16, moe_layer_ids=[1, 2])
    items[2][2000, 0] = [99, 0, 0, 0]           # a dense layer, not selected: ignored
    with pytest.raises(RouteValueError, match="3 bad"):
        ReplayBatch.from_vllm(items, num_experts=16, moe_layer_ids=[1, 2])
    items[2][10, 1] = [1, 2, 3, 16]
    with pytest.raises(RouteValueError, match=r"sequence 2, row 10 \(token 10\), layer 1: expert ids \[1, 2, 3, 16\] "
                                              r"out of range \[0, 16\) \(1 bad"):
        ReplayBatch.from_vllm(items, num_experts=16, moe_layer_ids=[1, 2])


def test_a_batch_too_large_for_the_host_is_a_replay_error_naming_its_size():
    with pytest.raises(ReplayMemoryError, match=r"\[1099511627776, 40, 22\] uint8 needs 901120\.0 GiB") as e:
        allocate((1 << 40, 40, 22), torch.uint8, what="vLLM ingest")
    assert isinstance(e.value, ReplayError) and isinstance(e.value, MemoryError)


def test_select_range_is_select_of_consecutive_sequences_without_a_copy():
    rng = np.random.default_rng(5)
    items = _engine_routes(rng, [5, 9, 1, 7], 2, set(), 2, 8, np.uint8)
    rb = ReplayBatch.from_vllm(items, num_experts=8)
    for a, b in ((0, 4), (1, 3), (2, 2), (3, 4)):
        part = rb.select_range(a, b)
        assert part.equals(rb.select(list(range(a, b))))
        assert part.routes.numel() == 0 or part.routes.data_ptr() == rb.routes[int(rb.offsets[a])].data_ptr()
    with pytest.raises(CoverageError, match="out of range"):
        rb.select_range(2, 5)
