"""Every validation error: its type (a `ReplayError` subclass) and a message naming the
sequence / row / layer; nothing half-applied (inputs unchanged after a failed call)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import r3bridge
from r3bridge import (
    CoverageError,
    LayerMappingError,
    ParallelLayout,
    ReplayBatch,
    ReplayError,
    RouteShapeError,
    RouteValueError,
)

from ._reference import random_routes


def _raises(exc, *fragments):
    """pytest.raises for ``exc`` that also checks it is a ReplayError and names ``fragments``."""
    class _Ctx:
        def __enter__(self):
            self._cm = pytest.raises(exc)
            self.info = self._cm.__enter__()
            return self.info

        def __exit__(self, *a):
            ok = self._cm.__exit__(*a)
            assert issubclass(self.info.type, ReplayError)
            msg = str(self.info.value)
            for f in fragments:
                assert f in msg, f"{f!r} not in {msg!r}"
            return ok
    return _Ctx()


def _seqs(seed=0, rows=(3, 4, 2), L=3, K=2, E=8):
    rng = np.random.default_rng(seed)
    return [random_routes(rng, r, L, K, E) for r in rows]


def _snapshot(arrays):
    return [a.copy() for a in arrays]


def _unchanged(arrays, snap):
    return all(np.array_equal(a, b) for a, b in zip(arrays, snap))


# ------------------------------------------------------------------------------ ids
@pytest.mark.parametrize("bad", [8, 200, -1])
def test_id_out_of_range_names_sequence_row_token_and_layer(bad):
    arrays = _seqs()
    arrays[1][2, 1, 0] = bad                      # sequence 1, row 2, layer index 1 -> layer id 7
    snap = _snapshot(arrays)
    with _raises(RouteValueError, "sequence 1", "row 2", "token 12", "layer 7", "out of range"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[3, 7, 11], start_rows=[0, 10, 0])
    assert _unchanged(arrays, snap)


def test_duplicate_ids_in_a_row_name_sequence_row_and_layer():
    arrays = _seqs()
    arrays[2][1, 2] = [5, 5]
    snap = _snapshot(arrays)
    with _raises(RouteValueError, "sequence 2", "row 1", "layer 2", "duplicate expert ids"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2])
    assert _unchanged(arrays, snap)


def test_zero_row_marked_valid_raises_but_invalid_zero_row_is_fine():
    arrays = _seqs(rows=(4,))
    arrays[0][3] = 0
    with _raises(RouteValueError, "sequence 0", "row 3", "duplicate"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2])
    v = np.array([True, True, True, False])
    rb = ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2], valid=[v])
    assert rb.valid.tolist() == v.tolist()


def test_out_of_range_ids_in_invalid_rows_are_ignored():
    arrays = _seqs(rows=(2,))
    arrays[0][0] = 99
    rb = ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2], valid=[np.array([False, True])])
    assert rb.routes[0].tolist() == [[0, 1]] * 3


# ------------------------------------------------------------------------------ shapes / dtypes
def test_inconsistent_topk_names_the_sequence():
    arrays = _seqs()
    arrays[2] = arrays[2][:, :, :1]
    with _raises(RouteShapeError, "sequence 2", "topk"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2])


def test_inconsistent_layer_count_names_the_sequence():
    arrays = _seqs()
    arrays[1] = arrays[1][:, :2]
    with _raises(RouteShapeError, "sequence 1", "layer count"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2])


@pytest.mark.parametrize("layer_ids, frag", [([0, 1, 1], "duplicate layer ids [1]"),
                                              ([0, 1], "2 entries"),
                                              ([0, -1, 2], "negative layer id")])
def test_bad_layer_ids(layer_ids, frag):
    with _raises(LayerMappingError, frag):
        ReplayBatch.from_ragged(_seqs(), num_experts=8, layer_ids=layer_ids)


@pytest.mark.parametrize("bad", [np.zeros((2, 1, 1), dtype=np.float32), np.zeros((2, 1, 1), dtype=bool),
                                 torch.zeros(2, 1, 1), torch.zeros(2, 1, 1, dtype=torch.bool)])
def test_non_integer_dtype_names_the_sequence(bad):
    ok = np.zeros((2, 1, 1), dtype=np.int64)
    with _raises(RouteShapeError, "sequence 1", "integer dtype"):
        ReplayBatch.from_ragged([ok, bad], num_experts=4, layer_ids=[0])


@pytest.mark.parametrize("shape", [(3,), (3, 2), (1, 3, 1, 2)])
def test_wrong_rank_names_the_sequence(shape):
    arrays = _seqs(rows=(2,), L=1, K=2)
    arrays.append(np.zeros(shape, dtype=np.int64))
    with _raises(RouteShapeError, "sequence 1", "[rows, layers, topk]"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0])
    with _raises(RouteShapeError, "[rows, layers, topk]"):
        ReplayBatch.from_packed(np.zeros(shape, dtype=np.int64), [shape[0]], num_experts=8, layer_ids=[0])


def test_topk_greater_than_num_experts():
    a = np.array([[[0, 1, 2]]])
    with _raises(RouteShapeError, "topk 3", "num_experts=2"):
        ReplayBatch.from_ragged([a], num_experts=2, layer_ids=[0])
    with _raises(RouteShapeError, "num_experts must be positive"):
        ReplayBatch.from_ragged([a], num_experts=0, layer_ids=[0])


# ------------------------------------------------------------------------------ coverage
def test_start_rows_and_valid_and_policy_versions_shapes():
    arrays = _seqs()
    with _raises(CoverageError, "start_rows has 2 entries for 3 sequences"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2], start_rows=[0, 0])
    with _raises(CoverageError, "sequence 1", "negative start row"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2], start_rows=[0, -2, 0])
    with _raises(CoverageError, "sequence 2", "valid mask"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2],
                                valid=[np.ones(3), np.ones(4), np.ones(3)])
    with _raises(CoverageError, "policy_versions"):
        ReplayBatch.from_ragged(arrays, num_experts=8, layer_ids=[0, 1, 2], policy_versions=[1])
    with _raises(CoverageError, "sums to 8"):
        ReplayBatch.from_packed(np.concatenate(arrays), [3, 4, 1], num_experts=8, layer_ids=[0, 1, 2])


def test_row_counts_that_do_not_fit_the_sequence():
    """rows = seq_len or seq_len - 1 (from start 0); more than seq_len, or fewer than
    seq_len - 1 without a start row, raises naming the sequence."""
    rb = ReplayBatch.from_ragged(_seqs(rows=(5, 5)), num_experts=8, layer_ids=[0, 1, 2])
    rb.check_seq_lens([5, 6])
    with _raises(CoverageError, "sequence 1", "ends at token 5", "4 tokens"):
        rb.check_seq_lens([5, 4])                # more rows than tokens
    with _raises(CoverageError, "sequence 0", "ends at token 5", "7 tokens"):
        rb.check_seq_lens([7, 5])                # fewer than seq_len - 1, no start row
    started = ReplayBatch.from_ragged(_seqs(rows=(5,)), num_experts=8, layer_ids=[0, 1, 2], start_rows=[2])
    started.check_seq_lens([7])                  # [2, 7) covers up to the end
    with _raises(CoverageError, "sequence 0"):
        started.check_seq_lens([9])
    lay = ParallelLayout(3, 1)
    with _raises(CoverageError, "sequence 0"):
        r3bridge.shard(rb, lay, [7, 5])


def test_failed_stitch_leaves_pieces_unchanged():
    a = ReplayBatch.from_ragged(_seqs(rows=(3,)), num_experts=8, layer_ids=[0, 1, 2])
    b = ReplayBatch.from_ragged(_seqs(1, rows=(2,)), num_experts=8, layer_ids=[0, 1, 2], start_rows=[5])
    ra, rb_ = a.routes.clone(), b.routes.clone()
    with _raises(r3bridge.StitchError, "sequence 0", "gap"):
        r3bridge.stitch([a, b])
    assert torch.equal(a.routes, ra) and torch.equal(b.routes, rb_)


def test_every_error_class_is_a_replay_error():
    for name in ("RouteValueError", "RouteShapeError", "CoverageError", "LayerMappingError", "LayoutError",
                 "PayloadError", "StitchError", "ConfigError", "ReplayStateError"):
        assert issubclass(getattr(r3bridge, name), r3bridge.ReplayError)


def test_empty_and_malformed_edges_stay_replay_errors():
    empty = ReplayBatch.from_ragged([], num_experts=8, layer_ids=[0])
    rb, report = r3bridge.stitch([empty, empty])            # used to raise torch's ValueError
    assert rb.num_seqs == 0 and report.overlap_rows == []
    none = ReplayBatch.from_sglang([], num_experts=8, num_layers=1, topk=2)
    assert none.topk == 2                                   # the engine's top-k, so concat works
    one = ReplayBatch.from_sglang([{"routed_experts": np.array([[[0, 1]]], np.int32), "prompt_tokens": 1,
                                    "completion_tokens": 1}], num_experts=8, num_layers=1, topk=2)
    assert ReplayBatch.concat([none, one]).rows_per_seq == [1]
    two = ReplayBatch.from_ragged([np.array([[[0, 1], [2, 3]]])], num_experts=8, layer_ids=[4, 5])
    with pytest.raises(LayerMappingError, match=r"duplicate layer ids \[4\]"):
        two.with_layers([4, 4])
    with pytest.raises(r3bridge.PayloadError, match="must be bytes, got str"):
        ReplayBatch.from_bytes("x")
