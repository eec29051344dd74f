"""`ReplayBatch`: construction, dtype narrowing, validity, select / concat / with_layers,
from_padded (left / right padding, holes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import r3bridge
from r3bridge import CoverageError, LayerMappingError, ReplayBatch, RouteShapeError, route_dtype

from ._reference import random_routes


def _batch(rng, rows, L=3, K=2, E=16, layer_ids=None, **kw):
    arrays = [random_routes(rng, r, L, K, E) for r in rows]
    return arrays, ReplayBatch.from_ragged(arrays, num_experts=E,
                                           layer_ids=layer_ids or list(range(L)), **kw)


# ------------------------------------------------------------------------------ construction
def test_from_ragged_packs_sequences_in_order_with_offsets():
    rng = np.random.default_rng(0)
    arrays, rb = _batch(rng, [4, 0, 3], layer_ids=[1, 5, 9], start_rows=[0, 2, 7])
    assert rb.rows_per_seq == [4, 0, 3] and rb.start_rows == [0, 2, 7]
    assert rb.layer_ids == (1, 5, 9) and rb.num_experts == 16 and rb.topk == 2
    assert rb.offsets.tolist() == [0, 4, 4, 7]
    assert np.array_equal(rb.routes.numpy(), np.concatenate(arrays))
    assert rb.valid.all() and rb.coverage == 1.0
    for i, a in enumerate(arrays):
        r, v = rb.sequence(i)
        assert np.array_equal(r.numpy(), a) and v.all()


@pytest.mark.parametrize("E, dtype", [(1, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                      (32767, torch.int16), (32768, torch.int32), (100000, torch.int32)])
def test_dtype_narrowing(E, dtype):
    assert route_dtype(E) == dtype
    top = np.array([[[E - 1]]], dtype=np.int64)          # the largest id survives narrowing
    rb = ReplayBatch.from_ragged([top], num_experts=E, layer_ids=[0])
    assert rb.routes.dtype == dtype and int(rb.routes[0, 0, 0]) == E - 1


@pytest.mark.parametrize("np_dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64])
def test_any_int_dtype_accepted(np_dtype):
    a = np.array([[[3, 1]], [[0, 2]]], dtype=np_dtype)
    rb = ReplayBatch.from_ragged([a, torch.from_numpy(a.astype(np.int64))], num_experts=4, layer_ids=[0])
    assert rb.routes.dtype == torch.uint8
    assert rb.routes.tolist() == [[[3, 1]], [[0, 2]], [[3, 1]], [[0, 2]]]


def test_mixed_dtypes_do_not_wrap_large_ids_into_range():
    """Sequence 0 uint8, sequence 1 int64 holding 2**32 + 1: must not wrap to 1 and pass."""
    a = np.array([[[1]]], dtype=np.uint8)
    b = np.array([[[2 ** 32 + 1]]], dtype=np.int64)
    with pytest.raises(r3bridge.RouteValueError, match="sequence 1"):
        ReplayBatch.from_ragged([a, b], num_experts=4, layer_ids=[0])


def test_invalid_rows_get_distinct_fillers_and_input_is_not_mutated():
    routes = np.array([[[3, 2]], [[0, 0]], [[1, 3]]], dtype=np.int64)   # row 1: engine zero row
    keep = routes.copy()
    rb = ReplayBatch.from_ragged([routes], num_experts=4, layer_ids=[0],
                                 valid=[np.array([True, False, True])])
    assert rb.valid.tolist() == [True, False, True]
    assert rb.routes.tolist() == [[[3, 2]], [[0, 1]], [[1, 3]]]
    assert np.array_equal(routes, keep)
    assert rb.coverage == pytest.approx(2 / 3)


def test_writable_numpy_input_is_not_aliased():
    a = np.array([[[1, 2]]], dtype=np.uint8)
    rb = ReplayBatch.from_ragged([a], num_experts=4, layer_ids=[0])
    a[0, 0, 0] = 3
    assert rb.routes.tolist() == [[[1, 2]]]
    t = torch.tensor([[[1, 2]]], dtype=torch.uint8)
    rb = ReplayBatch.from_packed(t, [1], num_experts=4, layer_ids=[0])
    t[0, 0, 0] = 3
    assert rb.routes.tolist() == [[[1, 2]]]


def test_empty_batch():
    rb = ReplayBatch.from_ragged([], num_experts=8, layer_ids=[])
    assert rb.num_seqs == 0 and rb.total_rows == 0 and rb.coverage == 0.0
    assert ReplayBatch.from_bytes(rb.to_bytes()).equals(rb)


# ------------------------------------------------------------------------------ select / concat / layers
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 6), min_size=1, max_size=6), seed=st.integers(0, 2 ** 16),
       data=st.data())
def test_select_concat_roundtrip(rows, seed, data):
    rng = np.random.default_rng(seed)
    n = len(rows)
    starts = [int(x) for x in rng.integers(0, 5, n)]
    valid = [rng.random(r) > 0.2 for r in rows]
    arrays, rb = _batch(rng, rows, start_rows=starts, valid=valid, policy_versions=list(range(n)))
    idx = data.draw(st.lists(st.integers(0, n - 1), max_size=8))
    sel = rb.select(idx)
    assert sel.rows_per_seq == [rows[i] for i in idx]
    assert sel.start_rows == [starts[i] for i in idx]
    assert sel.policy_versions == idx
    for j, i in enumerate(idx):
        r, v = sel.sequence(j)
        r0, v0 = rb.sequence(i)
        assert torch.equal(r, r0) and torch.equal(v, v0)
    # split into two halves and concat back
    cut = data.draw(st.integers(0, n))
    a, b = rb.select(range(cut)), rb.select(range(cut, n))
    if cut and cut < n:
        back = ReplayBatch.concat([a, b])
        assert back.equals(rb) and back.offsets.tolist() == rb.offsets.tolist()
        assert back.policy_versions == rb.policy_versions


def test_select_out_of_range_raises():
    _, rb = _batch(np.random.default_rng(0), [2, 3])
    for bad in ([2], [-1]):
        with pytest.raises(CoverageError, match="out of range"):
            rb.select(bad)


def test_concat_schema_mismatch_raises():
    rng = np.random.default_rng(0)
    _, a = _batch(rng, [2], layer_ids=[0, 1, 2])
    _, b = _batch(rng, [2], layer_ids=[0, 1, 3])
    with pytest.raises(LayerMappingError, match="batch 1"):
        ReplayBatch.concat([a, b])
    with pytest.raises(CoverageError):
        ReplayBatch.concat([])


def test_with_layers_selects_columns_by_id_in_given_order():
    rng = np.random.default_rng(1)
    arrays, rb = _batch(rng, [3, 2], L=4, layer_ids=[3, 5, 7, 9])
    sub = rb.with_layers([9, 3])
    assert sub.layer_ids == (9, 3)
    full = np.concatenate(arrays)
    assert np.array_equal(sub.routes.numpy(), full[:, [3, 0]])
    with pytest.raises(LayerMappingError, match=r"\[4\]"):
        rb.with_layers([3, 4])


def test_equals_compares_routes_validity_and_schema():
    rng = np.random.default_rng(2)
    arrays, a = _batch(rng, [3])
    b = ReplayBatch.from_ragged(arrays, num_experts=16, layer_ids=[0, 1, 2])
    assert a.equals(b)
    arrays[0][1, 0] = arrays[0][1, 0][::-1]               # same set, other order: a different route row
    assert not a.equals(ReplayBatch.from_ragged(arrays, num_experts=16, layer_ids=[0, 1, 2]))
    assert not a.equals(ReplayBatch.from_ragged(arrays, num_experts=17, layer_ids=[0, 1, 2]))


# ------------------------------------------------------------------------------ from_padded
@pytest.mark.parametrize("side", ["left", "right"])
def test_from_padded_left_and_right(side):
    rng = np.random.default_rng(3)
    lens = [5, 2, 0, 7]
    B, S, L, K, E = len(lens), 7, 2, 2, 8
    routes = np.zeros((B, S, L, K), dtype=np.int64)
    mask = np.zeros((B, S), dtype=bool)
    per_seq = []
    for i, n in enumerate(lens):
        a = random_routes(rng, n, L, K, E)
        sl = slice(S - n, S) if side == "left" else slice(0, n)
        routes[i, sl] = a
        mask[i, sl] = True
        per_seq.append(a)
    rb = ReplayBatch.from_padded(routes, mask.astype(np.int64), num_experts=E, layer_ids=[0, 4])
    assert rb.rows_per_seq == lens and rb.start_rows == [0] * B and rb.layer_ids == (0, 4)
    for i, a in enumerate(per_seq):
        assert np.array_equal(rb.sequence(i)[0].numpy(), a)
    # per-token validity: mark the second real token of sequence 0 as route-less
    valid = mask.copy()
    first = S - lens[0] if side == "left" else 0
    valid[0, first + 1] = False
    rb2 = ReplayBatch.from_padded(torch.from_numpy(routes), torch.from_numpy(mask), num_experts=E,
                                  layer_ids=[0, 4], valid=valid)
    assert rb2.sequence(0)[1].tolist() == [True, False, True, True, True]
    assert rb2.sequence(0)[0][1].tolist() == [[0, 1], [0, 1]]


def test_from_padded_holes_raise_naming_the_sequence():
    routes = np.zeros((2, 4, 1, 1), dtype=np.int64)
    mask = np.array([[1, 1, 1, 0], [1, 0, 1, 0]])
    with pytest.raises(CoverageError, match="sequence 1"):
        ReplayBatch.from_padded(routes, mask, num_experts=4, layer_ids=[0])


def test_from_padded_shape_errors():
    with pytest.raises(RouteShapeError, match="batch, seq, layers, topk"):
        ReplayBatch.from_padded(np.zeros((2, 4, 1), dtype=np.int64), np.ones((2, 4)), num_experts=4, layer_ids=[0])
    with pytest.raises(RouteShapeError, match="attention_mask shape"):
        ReplayBatch.from_padded(np.zeros((2, 4, 1, 1), dtype=np.int64), np.ones((2, 5)), num_experts=4, layer_ids=[0])
    with pytest.raises(RouteShapeError, match="valid mask shape"):
        ReplayBatch.from_padded(np.zeros((2, 4, 1, 1), dtype=np.int64), np.ones((2, 4)), num_experts=4,
                                layer_ids=[0], valid=np.ones((2, 3)))
