"""Multi-turn / resubmit stitching: append-only by start row, first-seen valid rows win,
duplicates deduplicated, disagreements counted, gaps raise."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3bridge import LayerMappingError, ReplayBatch, StitchError, StitchReport, stitch

from ._reference import random_routes

E, L, K = 32, 2, 2


def piece(per_seq, starts, valid=None):
    return ReplayBatch.from_ragged(per_seq, num_experts=E, layer_ids=[0, 3], start_rows=starts, valid=valid)


def test_multi_turn_later_prefill_does_not_overwrite_decode_routes():
    rng = np.random.default_rng(0)
    turn1 = random_routes(rng, 10, L, K, E)                  # rows [0, 10): prompt + first answer
    turn2 = random_routes(rng, 16, L, K, E)                  # later prefill re-routes [0, 10) ...
    turn2[:10] = turn1
    turn2[3] = (turn1[3] + 1) % E                            # ... differently on two rows
    turn2[7, 1] = (turn1[7, 1] + 1) % E
    out, rep = stitch([piece([turn1], [0]), piece([turn2], [0])])
    assert out.rows_per_seq == [16] and out.start_rows == [0]
    assert np.array_equal(out.routes.numpy()[:10], turn1)     # first-seen kept
    assert np.array_equal(out.routes.numpy()[10:], turn2[10:])
    assert rep.overlap_rows == [10] and rep.disagreeing_rows == [2] and rep.total_disagreeing == 2
    assert rep.as_metrics()["r3bridge/stitch/disagreeing_rows"] == 2.0


def test_resubmit_whole_prefix_again_is_deduplicated_not_concatenated():
    rng = np.random.default_rng(1)
    first = random_routes(rng, 8, L, K, E)
    again = np.concatenate([first, random_routes(rng, 5, L, K, E)])   # aborted, resubmitted from 0
    out, rep = stitch([piece([first], [0]), piece([again], [0])])
    assert out.rows_per_seq == [13]                           # not 8 + 13 = 21
    assert np.array_equal(out.routes.numpy(), again)
    assert rep.overlap_rows == [8] and rep.disagreeing_rows == [0]


def test_append_with_start_row_and_piece_before_existing_rows():
    rng = np.random.default_rng(2)
    a = random_routes(rng, 5, L, K, E)                        # rows [5, 10)
    b = random_routes(rng, 8, L, K, E)                        # rows [0, 8)
    c = random_routes(rng, 3, L, K, E)                        # rows [10, 13), adjacent
    out, rep = stitch([piece([a], [5]), piece([b], [0]), piece([c], [10])])
    assert out.start_rows == [0] and out.rows_per_seq == [13]
    want = np.concatenate([b[:5], a, c])
    assert np.array_equal(out.routes.numpy(), want)
    assert rep.overlap_rows == [3]


def test_invalid_rows_are_filled_by_a_later_piece_and_counted():
    rng = np.random.default_rng(3)
    a = random_routes(rng, 6, L, K, E)
    b = random_routes(rng, 6, L, K, E)
    va = np.array([True, False, True, True, False, True])
    b[2:4] = a[2:4]                                           # rows 0 and 5 disagree, 2 and 3 agree
    b[5] = (a[5] + 1) % E
    out, rep = stitch([piece([a], [0], [va]), piece([b], [0])])
    assert out.valid.all()
    want = np.where(va[:, None, None], a, b)
    assert np.array_equal(out.routes.numpy(), want)
    assert rep.filled_rows == [2] and rep.overlap_rows == [6]
    assert rep.disagreeing_rows == [int(not np.array_equal(a[0], b[0])) + 1]


def test_gap_raises_and_schema_mismatch_raises():
    rng = np.random.default_rng(4)
    a = piece([random_routes(rng, 4, L, K, E)], [0])
    b = piece([random_routes(rng, 2, L, K, E)], [5])         # rows [5, 7) after [0, 4): gap at 4
    with pytest.raises(StitchError, match="sequence 0, piece 1"):
        stitch([a, b])
    other = ReplayBatch.from_ragged([random_routes(rng, 2, L, K, E)], num_experts=E, layer_ids=[0, 4])
    with pytest.raises(LayerMappingError, match="piece 1"):
        stitch([a, other])
    with pytest.raises(StitchError, match="2 sequences"):
        stitch([a, piece([random_routes(rng, 2, L, K, E)] * 2, [0, 0])])
    with pytest.raises(StitchError):
        stitch([])


def test_sequences_are_stitched_independently_and_empty_pieces_skipped():
    rng = np.random.default_rng(5)
    s0 = random_routes(rng, 4, L, K, E)
    s1 = random_routes(rng, 6, L, K, E)
    p0 = piece([s0, s1[:0]], [0, 0])
    p1 = piece([s0[:0], s1], [9, 2])
    out, rep = stitch([p0, p1])
    assert out.rows_per_seq == [4, 6] and out.start_rows == [0, 2]
    assert np.array_equal(out.sequence(1)[0].numpy(), s1)
    assert isinstance(rep, StitchReport) and rep.overlap_rows == [0, 0]


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_stitch_equals_first_seen_dictionary_reference(data):
    """Pieces cover random contiguous ranges that touch or overlap what came before; the result
    must equal a per-token dictionary where the first valid route seen for a token wins."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    n_pieces = data.draw(st.integers(1, 4))
    pieces, first_seen, lo, hi = [], {}, None, None
    overlap = disagree = 0
    for _ in range(n_pieces):
        if lo is None:
            s = data.draw(st.integers(0, 5))
        else:
            s = data.draw(st.integers(max(0, lo - 3), hi))        # touches or overlaps [lo, hi)
        r = data.draw(st.integers(1 if lo is not None and s > hi - 1 else 0, 8))
        if lo is not None and s + r < lo:
            r = lo - s                                            # must reach the existing range
        a = random_routes(rng, r, L, K, E)
        v = rng.random(r) > 0.25
        for j in range(r):
            pos = s + j
            if lo is not None and lo <= pos < hi:
                overlap += 1
                old = first_seen[pos]
                if old[1] and v[j] and not np.array_equal(old[0], a[j]):
                    disagree += 1
            if pos not in first_seen or (not first_seen[pos][1] and v[j]):
                first_seen[pos] = (a[j], bool(v[j]))
        if r:
            lo = s if lo is None else min(lo, s)
            hi = s + r if hi is None else max(hi, s + r)
        pieces.append(piece([a], [s], [v]))
    out, rep = stitch(pieces)
    if lo is None:
        assert out.rows_per_seq == [0]
        return
    assert out.start_rows == [lo] and out.rows_per_seq == [hi - lo]
    routes, valid = out.sequence(0)
    for pos in range(lo, hi):
        want, ok = first_seen[pos]
        assert bool(valid[pos - lo]) == ok
        if ok:
            assert np.array_equal(routes[pos - lo].numpy(), want)
        else:
            assert routes[pos - lo].tolist() == [[0, 1]] * L
    assert rep.overlap_rows == [overlap] and rep.disagreeing_rows == [disagree]
