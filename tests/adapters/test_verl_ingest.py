"""verl's ``routed_experts`` transport -> ReplayBatch, built with verl's own padding utilities.

The padded batch mimics verl 0.9.1's agent loop exactly: prompts left-padded, responses
right-padded, rollout routes placed at the prompt's first token (``start_pos``), zero elsewhere,
every decoder layer (dense ones zero), int16. ``left_right_2_no_padding`` (verl's) turns it into
the nested jagged layout the engine sees.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import verl  # noqa: E402,F401  (installed by `make install`: never skipped)
from _verl_batches import MOE, NUM_LAYERS, E, K, make_verl_batch  # noqa: E402
from _verl_runner import VerlFixtures  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402

from r3bridge import ReplayBatch  # noqa: E402
from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, handed_routes  # noqa: E402
from r3bridge.adapters.verl.nested import nested_routes  # noqa: E402
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError, RouteValueError  # noqa: E402
from r3bridge.testing.kit.suite import BaseIngestTests  # noqa: E402


class TestVerlIngest(BaseIngestTests, VerlFixtures):
    """Conformance checks 1-3 on verl's own batches and micro-batching."""


def expected_rollout_batch(engine, prompt_lens, resp_lens):
    """Independent construction: MoE columns, one row per fed token (tokens - 1), explicit validity."""
    routes, valid = [], []
    for arr, p, r in zip(engine, prompt_lens, resp_lens):
        n_rows = p + r - 1
        full = np.zeros((n_rows, len(MOE), K), dtype=np.int64)
        v = np.zeros(n_rows, dtype=bool)
        full[: len(arr)] = arr[:, MOE]
        v[: len(arr)] = True
        routes.append(full)
        valid.append(v)
    return ReplayBatch.from_ragged(routes, num_experts=E, layer_ids=MOE, valid=valid, route_kind="rollout")


def test_left_right_2_no_padding_batch_converts_exactly():
    pl, rl = [6, 3, 4], [5, 2, 1]
    td, engine = make_verl_batch(pl, rl)
    assert td[ROUTES_KEY].is_nested and td[ROUTES_KEY].dtype == torch.int16
    rb = handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                       num_hidden_layers=NUM_LAYERS).to_batch()
    exp = expected_rollout_batch(engine, pl, rl)
    assert rb.equals(exp)
    assert rb.routes.dtype == torch.uint8 and rb.route_kind == "rollout"
    assert rb.rows_per_seq == [p + r - 1 for p, r in zip(pl, rl)]
    assert bool(rb.valid.all())
    seq_lens = td["input_ids"].offsets().diff().tolist()
    rb.check_seq_lens(seq_lens)                        # last token has no route: rows = seq_len - 1


def test_zero_tail_rows_are_invalid_never_replayed():
    # multi-turn: the engine stopped recording 3 rows early; a padding sample has no routes at all
    pl, rl = [5, 4, 2], [4, 3, 2]
    td, engine = make_verl_batch(pl, rl, returned_rows=[None, 3, 0])
    rb = handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                       num_hidden_layers=NUM_LAYERS).to_batch()
    assert rb.equals(expected_rollout_batch(engine, pl, rl))
    _, v1 = rb.sequence(1)
    assert v1.tolist() == [True] * 3 + [False] * 3
    r2, v2 = rb.sequence(2)
    assert not bool(v2.any())
    assert r2.tolist() == [[[0, 1]] * len(MOE)] * 3       # canonical distinct fillers, never duplicates
    with pytest.raises(CoverageError, match="verl sample micro-batch position 1: token 3 has no route"):
        handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                      num_hidden_layers=NUM_LAYERS).to_batch(invalid_rows="error")


def test_layer_count_and_layout_errors():
    td, _ = make_verl_batch([3], [2])
    with pytest.raises(LayerMappingError, match="num_hidden_layers"):
        handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                      num_hidden_layers=NUM_LAYERS + 1).to_batch()
    with pytest.raises(LayerMappingError, match="recorded"):
        handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="recorded").to_batch()
    dense = TensorDict({ROUTES_KEY: torch.zeros(1, 4, NUM_LAYERS, K, dtype=torch.int16)}, batch_size=[1])
    with pytest.raises(RouteShapeError, match="nested"):
        handed_routes(dense, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                      num_hidden_layers=NUM_LAYERS).to_batch()
    with pytest.raises(RouteShapeError, match="no 'routed_experts'"):
        handed_routes(TensorDict({}, batch_size=[1]), moe_layer_ids=MOE, num_experts=E,
                      route_kind="rollout", num_hidden_layers=NUM_LAYERS).to_batch()


def test_moe_only_routes_need_layer_axis():
    """A TensorRT-LLM-style ``routed_experts`` (MoE layers only) in verl's field: refused unless the
    ``r3bridge.layer_axis`` option says so, then read onto the same layers as the all-hidden form."""
    pl, rl = [4, 3], [3, 2]
    td, engine = make_verl_batch(pl, rl)
    wide = td[ROUTES_KEY]
    narrow = torch.nested.nested_tensor_from_jagged(wide.values()[:, MOE].contiguous(), wide.offsets())
    moe_only = TensorDict({ROUTES_KEY: narrow}, batch_size=[len(pl)])
    with pytest.raises(LayerMappingError, match="set layer_axis='moe_only'"):
        handed_routes(moe_only, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                      num_hidden_layers=NUM_LAYERS).to_batch()
    rb = handed_routes(moe_only, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                       num_hidden_layers=NUM_LAYERS, layer_axis="moe_only").to_batch()
    assert rb.equals(expected_rollout_batch(engine, pl, rl))


def test_corrupt_row_with_duplicates_raises():
    td, _ = make_verl_batch([3], [2])
    v = td[ROUTES_KEY].values()
    v[0, 2] = torch.tensor([5, 5], dtype=torch.int16)    # duplicate ids in a valid row
    with pytest.raises(RouteValueError):
        handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                      num_hidden_layers=NUM_LAYERS).to_batch()


def test_top1_zero_rows():
    routes = torch.nested.nested_tensor_from_jagged(
        torch.tensor([[[3]], [[0]], [[0]]], dtype=torch.int16), offsets=torch.tensor([0, 3]))
    td = TensorDict({ROUTES_KEY: routes}, batch_size=[1])
    rb = handed_routes(td, moe_layer_ids=[0], num_experts=4, route_kind="rollout", num_hidden_layers=1).to_batch()
    assert rb.rows_per_seq == [2] and rb.valid.tolist() == [True, False]   # expert-0 row: ambiguous -> native
    rec = handed_routes(td, moe_layer_ids=[0], num_experts=4, route_kind="recorded").to_batch()
    assert rec.rows_per_seq == [3] and bool(rec.valid.all())                # recorded rows are always real


def _recorded(seq_lens, seed=1):
    rng = np.random.default_rng(seed)
    routes = [np.stack([np.stack([rng.choice(E, K, replace=False) for _ in MOE]) for _ in range(n)])
              for n in seq_lens]
    return ReplayBatch.from_ragged(routes, num_experts=E, layer_ids=MOE, route_kind="recorded")


def test_recorded_round_trip_survives_dynamic_micro_batching():
    """R2: routes travel per sample in verl's TensorDict, so verl's dynamic-bsz re-partitioning of the
    update mini-batch (a different order than compute_log_prob's) keeps every route with its sample."""
    pl, rl = [6, 3, 4, 2, 5, 1], [5, 2, 1, 4, 3, 5]
    td, _ = make_verl_batch(pl, rl, seed=3)
    seq_lens = td["input_ids"].offsets().diff().tolist()
    rec = _recorded(seq_lens)
    td[ROUTES_KEY] = nested_routes(rec)
    assert td[ROUTES_KEY].dtype == torch.int16 and td[ROUTES_KEY].values().shape[1:] == (len(MOE), K)
    assert handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="recorded").to_batch().equals(rec)
    td[SAMPLE_KEY] = torch.arange(len(seq_lens))
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=14)
    micro, idx = prepare_micro_batches(td, dp_group=None, same_micro_num_in_dp=False)
    assert len(micro) > 1
    seen = []
    for mb in micro:
        ids = mb[SAMPLE_KEY].tolist()
        seen += ids
        got = handed_routes(mb, moe_layer_ids=MOE, num_experts=E, route_kind="recorded").to_batch()
        for j, sid in enumerate(ids):
            r, v = got.sequence(j)
            r0, v0 = rec.sequence(sid)
            assert torch.equal(r, r0) and torch.equal(v, v0)
    assert sorted(seen) == list(range(len(seq_lens)))
    assert seen != sorted(seen)                       # verl really re-ordered the samples


def test_provenance_is_read_from_verl_v1_nested_extra_fields_and_every_sample_is_counted():
    """verl 0.9.1's V1 trainer (TransferQueue) keeps the agent loop's extra_fields nested per sample:
    the tool loop's provenance is read from there; samples of verl's single-turn loop carry none and
    are counted unchecked (checked + unchecked = the batch's samples; issue 39: both stayed 0)."""
    from r3bridge.adapters.verl.codec import provenance_pairing
    from r3bridge.batch.provenance import LOGPROB_PROVENANCE_KEY, ROUTE_PROVENANCE_KEY, RouteProvenance

    same = RouteProvenance("hf_r3", "req-1", 3, 0)
    later = RouteProvenance("hf_r3", "req-2", 3, 1)
    import dataclasses

    # TransferQueue hands a RouteProvenance back as its fields (msgspec)
    extra = [{ROUTE_PROVENANCE_KEY: same, LOGPROB_PROVENANCE_KEY: same, "turns": 2},
             {"turns": 1},                                                      # single-turn loop: none
             {ROUTE_PROVENANCE_KEY: dataclasses.asdict(later), LOGPROB_PROVENANCE_KEY: dataclasses.asdict(same),
              "turns": 2},
             {"turns": 1}]
    td = TensorDict({"input_ids": torch.zeros(4, 3, dtype=torch.int64)}, batch_size=[4])
    tu.assign_non_tensor_stack(td, "extra_fields", extra)
    c = provenance_pairing(td).check("count")
    assert (c.checked, c.mismatched, c.unchecked) == (2, 1, 2)
    td2 = TensorDict({"input_ids": torch.zeros(4, 3, dtype=torch.int64)}, batch_size=[4])
    tu.assign_non_tensor_stack(td2, "extra_fields", [{"turns": 1}] * 4)
    assert provenance_pairing(td2).check("count").unchecked == 4


def test_the_losss_router_log_ratio_field_when_the_chunk_replayed_nothing_with_weights():
    """verl's loss wrapper: a chunk without MoE layers has no router log-ratio (``None``); the field
    the loss reads is then zeros in verl's jagged layout (was a ``TypeError`` inside the loss)."""
    from r3bridge.adapters.verl.nested import nested_like as log_ratio_field

    ids = torch.nested.nested_tensor([torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.int64)],
                                     layout=torch.jagged)
    zeros = log_ratio_field(None, ids)
    assert [t.tolist() for t in zeros.unbind()] == [[0.0, 0.0, 0.0], [0.0, 0.0]]
    given = log_ratio_field([torch.tensor([0.5, 0.0, -0.5]), torch.tensor([1.0, 2.0])], ids)
    assert [t.tolist() for t in given.unbind()] == [[0.5, 0.0, -0.5], [1.0, 2.0]]
