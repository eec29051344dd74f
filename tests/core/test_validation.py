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


def test_sequences_with_zero_rows_pass_in_every_form_whatever_their_start_row():
    """design.md's contract: a sequence handed with 0 rows (aborted, or a multi-turn tail) is allowed
    whatever its start row, has no route (valid False throughout) and is routed natively; the read
    says how many rows each sequence was handed (0: counted apart by the coverage guards)."""
    import base64

    from r3bridge.parallel.handed import HandedRoutes
    from r3bridge.parallel.rank_rows import RankRows
    from r3bridge.parallel.read import read_targets

    full = _seqs(rows=(6,))[0]                                    # [6, 3, K]: a 7-token sample
    L, K = full.shape[1:]
    empty = np.zeros((0, L, K), full.dtype)
    lens, starts = [7, 5, 9], [0, 0, 9]                           # sample 1 aborted, sample 2 a tail at its end
    lay = ParallelLayout(3, 1)
    want = r3bridge.shard(ReplayBatch.from_ragged([full], num_experts=8, layer_ids=[0, 1, 2]), lay, [7])

    def sglang(a, prompt, completion):
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "routed_experts": base64.b64encode(a.astype(np.int32).tobytes()).decode()}

    batches = {
        "from_ragged": ReplayBatch.from_ragged([full, empty, empty], num_experts=8, layer_ids=[0, 1, 2],
                                               start_rows=starts),
        "from_vllm": ReplayBatch.from_vllm([full, empty, empty], num_experts=8, start_rows=starts),
        "from_sglang": ReplayBatch.from_sglang([sglang(full, 3, 4), sglang(empty, 2, 3), sglang(empty, 4, 6)],
                                               num_experts=8, num_layers=L, topk=K, start_rows=[0, 4, 9]),
        "handed engine": HandedRoutes.from_engine([full, empty, empty], num_experts=8, start_rows=starts).to_batch(),
        "handed packed": HandedRoutes.from_packed(full, [6, 0, 0], num_experts=8, layer_ids=[0, 1, 2],
                                                  no_route="zero").to_batch(),
    }
    for form, rb in batches.items():
        assert rb.rows_per_seq == [6, 0, 0], form
        t = r3bridge.shard(rb, lay, lens)
        n0 = want.valid.numel()
        assert t.valid[:n0].tolist() == want.valid.tolist() and not t.valid[n0:].any(), form
        for lid in (0, 1, 2):
            assert torch.equal(t.indices[lid][:n0][want.valid], want.indices[lid][want.valid]), form
    t = r3bridge.rank_targets([full, empty, empty], lay, lens, num_experts=8, start_rows=starts)
    assert t.valid.sum() == want.valid.sum() and not t.valid[want.valid.numel():].any()
    handed = HandedRoutes.from_engine([full, empty, empty], num_experts=8, start_rows=starts)
    rows = RankRows.build(lay, lens, tp_rank=0, cp_rank=0).cover(handed)
    counts: list = []
    read_targets(handed, rows, [0, 1, 2], counts=counts)
    real = [int(((rows.seq == i) & (rows.pos < lens[i])).sum()) for i in range(3)]
    assert rows.unrouted_token_rows == real[1] + real[2] > 0
    assert counts[0].handed.tolist() == [6, 0, 0] and counts[0].token_pairs.tolist() == [3 * r for r in real]
    # a sequence with rows still has to fit its tokens
    with _raises(CoverageError, "sequence 0", "ends at token 6", "9 tokens", "0 rows"):
        r3bridge.shard(batches["from_ragged"], lay, [9, 5, 9])


def test_a_sample_one_row_short_is_refused_in_every_form_naming_the_framework_sample():
    """The row-count rule (prompt + generated - 1 rows, from the start row) holds for every form: the
    engine arrays read to a rank (the error names the adapter's sample, not "sequence 1"), and the
    masked and dense write-backs, which once wrote the short sample as a route-less tail."""
    from r3bridge.batch.dense import padded_routes
    from r3bridge.forms.masked import masked_padded_routes
    from r3bridge.parallel.handed import HandedRoutes
    from r3bridge.parallel.rank_rows import RankRows

    full, short = _seqs(rows=(6,))[0], _seqs(rows=(5,))[0]        # both samples have 7 tokens
    lay = ParallelLayout(3, 1)
    handed = HandedRoutes.from_engine([full, short], num_experts=8, names=["req-7", "req-9"], framework="myfw")
    with _raises(CoverageError, "myfw sample req-9", "ends at token 5", "7 tokens") as err:
        RankRows.build(lay, [7, 7], tp_rank=0, cp_rank=0).cover(handed)
    assert "sequence 1" not in str(err.value)
    with _raises(r3bridge.errors.PayloadError, "myfw sample req-9") as err:
        HandedRoutes.from_engine([full, None], num_experts=8, names=["req-7", "req-9"], framework="myfw")
    assert "sequence 1" not in str(err.value)
    rb = ReplayBatch.from_ragged([full, short], num_experts=8, layer_ids=[0, 1, 2])
    attn = torch.ones(2, 7, dtype=torch.bool)
    with _raises(CoverageError, "sequence 1", "ends at token 5", "7 tokens"):
        masked_padded_routes(rb, attn, num_hidden_layers=3)
    with _raises(CoverageError, "myfw sample req-9", "ends at token 5", "7 tokens") as err:    # the write-back names it too
        masked_padded_routes(rb, attn, num_hidden_layers=3, names=["req-7", "req-9"], framework="myfw")
    assert "sequence 1" not in str(err.value)
    with _raises(CoverageError, "sequence 1", "ends at token 5"):
        padded_routes(rb, attn)
    masked_padded_routes(ReplayBatch.from_ragged([full, full], num_experts=8, layer_ids=[0, 1, 2]), attn,
                         num_hidden_layers=3)                      # N - 1 rows: fine


def test_one_degenerate_pair_counts_once_in_the_read():
    """``degenerate: native``: a (row, layer) pair whose ids repeat is counted as 1, as the error counts it."""
    from r3bridge.parallel.handed import HandedRoutes
    from r3bridge.parallel.rank_rows import RankRows
    from r3bridge.parallel.read import read_targets

    a, b = _seqs(rows=(6, 6))
    b = b.copy()
    b[2, 1] = b[2, 1, 0]                                          # sample 1, row 2, layer 1: ids repeat
    handed = HandedRoutes.from_engine([a, b], num_experts=8)
    rows = RankRows.build(ParallelLayout(3, 1), [7, 7], tp_rank=0, cp_rank=0).cover(handed)
    counts: list = []
    t = read_targets(handed, rows, [0, 1, 2], degenerate="native", counts=counts)
    assert counts[0].degenerate.tolist() == [0, 1]
    assert int((~t.valid).sum()) == 2 + 1                         # the two last tokens, and the degenerate row


def test_a_sample_masked_no_route_throughout_is_a_sample_without_routes():
    """The masked form carries an aborted sample as rows whose explicit mask says "no route": counted
    apart like 0 rows; zero rows are not explicit (a broken capture writes them too) and stay counted."""
    from r3bridge.parallel.handed import HandedRoutes
    from r3bridge.parallel.rank_rows import RankRows
    from r3bridge.parallel.read import read_targets

    full = torch.as_tensor(_seqs(rows=(7,))[0])
    grid = torch.stack([full, full, full])                              # [3, 7, L, K]
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[1] = False
    masked = HandedRoutes.from_padded(grid, torch.ones(3, 7), num_experts=8, layer_ids=[0, 1, 2], no_route="mask",
                                      valid=valid)
    zero = HandedRoutes.from_padded(grid, torch.ones(3, 7), num_experts=8, layer_ids=[0, 1, 2], no_route="zero")
    assert masked.without_routes().tolist() == [False, True, False]
    assert zero.without_routes().tolist() == [False, False, False]
    rows = RankRows.build(ParallelLayout(3, 1), [7, 7, 7], tp_rank=0, cp_rank=0).cover(masked)
    assert rows.unrouted_token_rows == 7
    counts: list = []
    read_targets(masked, rows, [0, 1, 2], counts=counts)
    assert counts[0].handed.tolist() == [7, 0, 7]
