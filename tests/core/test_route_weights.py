"""Routing weights (``ReplayBatch.weights``): validated, carried by every operation that moves
rows, on the wire (flags bit2), and decoded from SGLang's proposed field (SGLang #23999)."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch

import r3bridge
from r3bridge import (
    ParallelLayout,
    ReplayBatch,
    RouteProvenance,
    RouteWeightsError,
    rank_targets,
    shard,
    stitch,
    unshard,
)
from r3bridge.batch.canonical import canonical_form, with_empty_sequences
from r3bridge.parallel.packing import PackPlan, rank_positions

E, K = 16, 2


def weight_of(ids: torch.Tensor, layer: int) -> torch.Tensor:
    """A weight that names its (expert id, layer): exact in float16, so a weight that travels to
    another id or layer is seen."""
    return (ids.to(torch.float32) * 8 + layer) / 256


def make_batch(lens, layer_ids, *, seed=0, start_rows=None, valid=None):
    g = torch.Generator().manual_seed(seed)
    routes, weights = [], []
    for n in lens:
        r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * len(layer_ids))]).view(
            n, len(layer_ids), K
        )
        routes.append(r)
        weights.append(torch.stack([weight_of(r[:, j], lid) for j, lid in enumerate(layer_ids)], 1))
    return (
        ReplayBatch.from_ragged(
            routes, num_experts=E, layer_ids=layer_ids, weights=weights, start_rows=start_rows, valid=valid
        ),
        routes,
        weights,
    )


def assert_weights_name_ids(batch: ReplayBatch) -> None:
    for j, lid in enumerate(batch.layer_ids):
        want = weight_of(batch.routes[:, j].long(), lid) * batch.valid[:, None]
        assert torch.equal(batch.weights[:, j].float(), want)


# ------------------------------------------------------------------------------------- schema
def test_weights_are_float16_aligned_with_routes_and_zero_without_route():
    valid = [torch.tensor([True, False, True]), torch.tensor([True, True])]
    rb, _, _ = make_batch([3, 2], [0, 2], valid=valid)
    assert rb.weights.dtype == torch.float16 and rb.weights.shape == rb.routes.shape
    assert_weights_name_ids(rb)
    assert not bool(rb.weights[1].any())  # the invalid row: filler ids, weight 0
    assert (
        ReplayBatch.from_ragged(
            [torch.zeros((1, 1, K), dtype=torch.int64) + torch.arange(K)], num_experts=E, layer_ids=[0]
        ).weights
        is None
    )


@pytest.mark.parametrize(
    "bad, where",
    [
        (float("nan"), "sequence 1, row 1 (token 1), layer 2"),
        (-0.5, "sequence 1, row 1 (token 1), layer 2"),
        (1e6, "sequence 1, row 1 (token 1), layer 2"),  # finite in float32, inf in float16
    ],
)
def test_bad_weights_raise_naming_sequence_row_layer(bad, where):
    rb, routes, weights = make_batch([2, 3], [0, 2])
    weights[1][1, 1, 0] = bad
    with pytest.raises(RouteWeightsError, match=re.escape(where)):
        ReplayBatch.from_ragged(routes, num_experts=E, layer_ids=[0, 2], weights=weights)
    with pytest.raises(RouteWeightsError, match="sequence 0: weights have shape"):
        ReplayBatch.from_ragged(routes, num_experts=E, layer_ids=[0, 2], weights=[w[:, :1] for w in weights])
    with pytest.raises(RouteWeightsError, match="shape"):
        rb.with_weights(torch.zeros(rb.total_rows, 2, K + 1))
    assert issubclass(RouteWeightsError, r3bridge.ReplayError)


def test_row_operations_carry_weights():
    rb, _, _ = make_batch([3, 1, 4], [1, 3])
    for moved in (
        rb.select([2, 0]),
        rb.select_range(1, 3),
        rb.with_layers([3]),
        rb.to("cpu"),
        ReplayBatch.concat([rb, rb.select([1])]),
        with_empty_sequences(rb, [5, 2]),
        canonical_form(rb.select([0, 2]), [5, 6]),
    ):
        assert moved.weights is not None and moved.weights.shape == moved.routes.shape
        assert_weights_name_ids(moved)
    bare = ReplayBatch.from_packed(rb.routes, rb.rows_per_seq, num_experts=E, layer_ids=rb.layer_ids)
    with pytest.raises(RouteWeightsError, match="batch 1 lacks routing weights"):
        ReplayBatch.concat([rb, bare])
    assert not rb.equals(bare) and rb.equals(bare.with_weights(rb.weights))


def test_stitch_keeps_first_seen_weights():
    first, _, _ = make_batch([3], [0], seed=1)
    later, _, _ = make_batch([5], [0], seed=2)  # re-prefill of the prefix with other routes
    out, report = stitch([first, later])
    assert out.rows_per_seq == [5] and report.total_disagreeing > 0
    assert torch.equal(out.routes[:3], first.routes) and torch.equal(out.weights[:3], first.weights)
    assert torch.equal(out.weights[3:], later.weights[3:])
    assert_weights_name_ids(out)
    with pytest.raises(r3bridge.StitchError, match="piece 1 lacks routing weights"):
        stitch([first, later.with_weights(None)])


# --------------------------------------------------------------------------------------- wire
# A version-2 payload written by r3bridge before weights existed (main at 96e9d2f): two
# sequences, one invalid row, policy versions [5, 6].
OLD_PAYLOAD = bytes.fromhex(
    "523352420200010102000000030000000000000001000000020000000400000006006b21f57c72616767656401000000"
    "020000000000000001000000000000000000000000000000020000000000000005000000000000000600000000000000"
    "050001000103015e91bad2"
)


def test_wire_round_trip_with_weights_and_old_payloads_still_read():
    rb, _, _ = make_batch([3, 2], [0, 2], valid=[torch.tensor([True, False, True]), torch.ones(2, dtype=torch.bool)])
    data = rb.to_bytes()
    assert len(data) == rb.nbytes and data[7] & 4  # flags bit2
    back = ReplayBatch.from_bytes(data)
    assert back.equals(rb) and torch.equal(back.weights, rb.weights)
    plain = rb.with_weights(None).to_bytes()
    assert not plain[7] & 4 and len(data) - len(plain) == 2 * rb.routes.numel()
    assert ReplayBatch.from_bytes(plain).weights is None
    old = ReplayBatch.from_bytes(OLD_PAYLOAD)  # version 2: read through the v2 path
    assert OLD_PAYLOAD[4] == 2 and old.weights is None and old.provenance is None
    assert old.policy_versions == [5, 6] and old.rows_per_seq == [2, 1]
    flipped = bytearray(data)
    flipped[-4 - 1] ^= 0x40  # a byte of the weights section
    with pytest.raises(r3bridge.PayloadError, match="body checksum"):
        ReplayBatch.from_bytes(bytes(flipped))


def test_wire_round_trip_with_weights_and_provenance_together():
    # both optional sections in one payload: provenance (bit1) after the policy versions, weights
    # (bit2) after the routes; a flipped byte in either is caught by the body CRC
    rb, _, _ = make_batch([3, 2], [0, 2], valid=[torch.tensor([True, False, True]), torch.ones(2, dtype=torch.bool)])
    prov = (RouteProvenance("sglang", "req-0", 7, 1), None)
    both = ReplayBatch.from_packed(
        rb.routes,
        rb.rows_per_seq,
        num_experts=E,
        layer_ids=rb.layer_ids,
        valid=rb.valid,
        policy_versions=[3, 4],
        provenance=prov,
        weights=rb.weights,
    )
    data = both.to_bytes()
    assert data[7] == 1 | 2 | 4 and len(data) == both.nbytes
    back = ReplayBatch.from_bytes(data)
    assert back.equals(both) and torch.equal(back.weights, rb.weights)
    assert back.provenance == prov and back.policy_versions == [3, 4]
    # dropping the weights leaves the provenance section intact, and the payload shorter by exactly them
    no_w = both.with_weights(None).to_bytes()
    back_no_w = ReplayBatch.from_bytes(no_w)
    assert back_no_w.provenance == prov and back_no_w.weights is None and no_w[7] == 1 | 2
    assert len(data) - len(no_w) == 2 * rb.routes.numel()
    # row operations carry both fields (positional order: ..., _offsets, provenance, weights)
    sel = both.select([1, 0]).with_layers([2])
    assert sel.provenance == (None, prov[0]) and sel.policy_versions == [4, 3]
    assert torch.equal(sel.weights, torch.cat([rb.weights[3:], rb.weights[:3]])[:, 1:])
    assert ReplayBatch.concat([both, both.with_weights(rb.weights)]).provenance == prov + prov
    at = data.index(b"req-0")
    for pos in (at + 2, len(data) - 4 - 3):  # a byte of the request id, a byte of the weights
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        with pytest.raises(r3bridge.PayloadError, match="body checksum"):
            ReplayBatch.from_bytes(bytes(flipped))


# ------------------------------------------------------------------------ sharded / packed path
def test_weights_follow_their_routes_through_shard_unshard_and_rank_ingest():
    # 6 layers, MoE every other layer, TP2 x CP2 (zigzag, SP) x PP2: each rank holds a few runs of
    # each sequence's tokens and one stage's layers
    layout = ParallelLayout(6, [0, 1, 1, 0, 1, 1], tp=2, cp=2, pp=2)
    lens = [13, 6, 9]
    moe = layout.moe_layer_ids
    rb, routes, weights = make_batch([n - 1 for n in lens], moe, seed=3)  # last token has no route
    plan = PackPlan.build(layout, lens)
    # the engine's form: every decoder layer, dense ones as zero rows (ids and weights)
    all_routes, all_weights = [], []
    for r, w in zip(routes, weights):
        full_r = np.zeros((r.shape[0], layout.num_layers, K), dtype=np.uint8)
        full_w = np.zeros((r.shape[0], layout.num_layers, K), dtype=np.float32)
        full_r[:, moe], full_w[:, moe] = r.numpy(), w.numpy()
        all_routes.append(full_r)
        all_weights.append(full_w)
    per_rank = {}
    for tp in range(2):
        for cp in range(2):
            seq, pos = rank_positions(plan, layout, tp, cp)
            for pp in range(2):
                t = shard(rb, layout, lens, tp_rank=tp, cp_rank=cp, pp_rank=pp)
                assert set(t.weights) == set(t.layer_ids) == set(layout.moe_layers(pp))
                for lid in t.layer_ids:
                    w = t.weights[lid]
                    assert w.dtype == torch.float32
                    assert torch.equal(w, weight_of(t.indices[lid], lid) * t.valid[:, None])
                    # and each row's weight is its own token's, not only a consistent pair
                    j = moe.index(lid)
                    for r in t.valid.nonzero().squeeze(1).tolist():
                        s, p = int(seq[r]), int(pos[r])
                        assert torch.equal(w[r], weights[s][p, j].half().float())
                # the per-rank engine path gives the same targets and weights
                direct = rank_targets(
                    all_routes,
                    layout,
                    lens,
                    num_experts=E,
                    moe_layer_ids=moe,
                    tp_rank=tp,
                    cp_rank=cp,
                    pp_rank=pp,
                    weights=all_weights,
                )
                for lid in t.layer_ids:
                    assert torch.equal(direct.indices[lid], t.indices[lid])
                    assert torch.equal(direct.weights[lid], t.weights[lid])
                per_rank[(tp, cp, pp, 0)] = t
    back = unshard(per_rank, layout, lens, num_experts=E, rows_per_seq=[n - 1 for n in lens])
    assert back.equals(rb)


# ------------------------------------------------------------------------------------ decoders
def test_sglang_weights_decoded_when_present_all_or_none():
    num_layers, rows = 3, 4
    g = np.random.default_rng(0)
    ids = np.stack([np.stack([g.permutation(E)[:K] for _ in range(num_layers)]) for _ in range(rows)]).astype(np.int32)
    w = g.random((rows, num_layers, K)).astype(np.float32)
    mi = {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "routed_experts": base64.b64encode(ids.tobytes()).decode(),
        "routed_experts_weights": base64.b64encode(w.astype("<f4").tobytes()).decode(),
    }
    rb = ReplayBatch.from_sglang([mi, mi], num_experts=E, num_layers=num_layers, topk=K, moe_layer_ids=[1, 2])
    assert rb.weights.shape == (2 * rows, 2, K)
    assert torch.equal(rb.weights[:rows], torch.from_numpy(w[:, 1:]).half())
    bare = {k: v for k, v in mi.items() if k != "routed_experts_weights"}
    assert ReplayBatch.from_sglang([bare], num_experts=E, num_layers=num_layers, topk=K).weights is None
    with pytest.raises(RouteWeightsError, match="1 of 2 SGLang responses carry routing weights"):
        ReplayBatch.from_sglang([mi, bare], num_experts=E, num_layers=num_layers, topk=K)
    short = dict(mi, routed_experts_weights=base64.b64encode(w[:-1].tobytes()).decode())
    with pytest.raises(RouteWeightsError, match="sequence 0: 18 routing weights for 4 rows"):
        ReplayBatch.from_sglang([short], num_experts=E, num_layers=num_layers, topk=K)
    # vLLM: no weights of its own; a per-sequence array in the routes' shape where one is supplied
    v = ReplayBatch.from_vllm([ids], num_experts=E, moe_layer_ids=[0, 2], weights=[w])
    assert torch.equal(v.weights, torch.from_numpy(w[:, [0, 2]]).half())


# ------------------------------------------------------------------ routing-weights replay: the plans
@pytest.mark.parametrize("mode, weights, phase, plan", [
    # R3w: compute_log_prob replays the engine's ids and records their weights, updates replay the recording
    ("R3", "recorded", "compute_log_prob", ("replay", "rollout", False, True)),
    ("R3", "recorded", "update", ("replay", "recorded", True, False)),
    # R3 with an engine's weights: every pass replays the rollout's ids and weights
    ("R3", "rollout", "compute_log_prob", ("replay", "rollout", True, False)),
    ("R3", "rollout", "update", ("replay", "rollout", True, False)),
    # R2 with weights: the recording carries them, the updates replay them
    ("R2", "recorded", "compute_log_prob", ("record", None, False, True)),
    ("R2", "recorded", "update", ("replay", "recorded", True, False)),
    ("R3", "recorded", "ref_log_prob", ("native", None, False, False)),
    ("R3", "off", "update", ("replay", "rollout", False, False)),
])
def test_phase_plans_with_routing_weights(mode, weights, phase, plan):
    from r3bridge.config import Phase, ReplayConfig, phase_plan

    got = phase_plan(mode, phase, weights)
    assert (got.action.value, got.route_kind, got.replay_weights, got.record_weights) == plan
    assert got.records == (plan[0] == "record" or plan[3])
    assert ReplayConfig(replay_mode=mode, replay_weights=weights).plan(Phase(phase)) == got


@pytest.mark.parametrize("mode, weights, match", [
    ("R2", "rollout", "R2 takes replay_weights=recorded"),
    ("R3", "on", "replay_weights must be one of off, recorded, rollout"),
    ("R3", True, "replay_weights must be one of"),
])
def test_replay_weights_setting_refused_where_it_cannot_mean_anything(mode, weights, match):
    from r3bridge.config import ReplayConfig
    from r3bridge.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        ReplayConfig(replay_mode=mode, replay_weights=weights)


def test_replay_weights_off_spellings():
    from r3bridge.config import ReplayConfig

    assert ReplayConfig(replay_mode="R3", replay_weights=False).replay_weights == "off"
    assert ReplayConfig.from_mapping({"replay_mode": "R3", "replay_weights": "recorded"}).as_dict()[
        "replay_weights"] == "recorded"


def test_an_adapter_that_carries_no_recorded_weights_refuses_replay_weights_at_set_up():
    """``replay_weights`` through an adapter that does not hand compute_log_prob's recording
    (weights included) to its updates would fail only at the first update: its session refuses the
    setting when the worker sets up; an adapter that declares it carries them gets its session, and
    a model of another role (never replays) is not refused."""
    from r3bridge.errors import ConfigError
    from r3bridge.megatron.roles import Role
    from r3bridge.session import AdapterSession

    for setting in ("recorded", "rollout"):
        cfg = {"replay_mode": "R3", "replay_weights": setting}
        with pytest.raises(ConfigError, match=rf"replay_weights='{setting}': the verl adapter carries routing "
                                              r"weights as off only"):
            AdapterSession("verl", cfg, where=None)
        session = AdapterSession("template", cfg, where=None, routing_weights=("off", "recorded", "rollout"))
        assert session.config.replay_weights == setting
        assert AdapterSession("verl", cfg, where=None, role=Role.REFERENCE).config.replay_weights == setting


def test_replay_weights_with_replay_off_refused_on_the_options_in_force():
    """A section may set replay_weights and leave replay_mode to the environment: the section
    alone is accepted, the merged options are what is checked (by the adapter session, the
    Replayer and every phase plan); with replay off in the end, refused."""
    from r3bridge.config import Phase, ReplayConfig, phase_plan
    from r3bridge.errors import ConfigError
    from r3bridge.session import AdapterSession

    merged, _ = ReplayConfig.resolve_with_origin({"replay_weights": "recorded"}, {"R3BRIDGE_REPLAY_MODE": "R3"})
    assert (merged.replay_mode.value, merged.replay_weights) == ("R3", "recorded")
    off = ReplayConfig(replay_weights="recorded")
    for refuse in (lambda: phase_plan("off", "update", "recorded"), lambda: off.plan(Phase.UPDATE),
                   lambda: AdapterSession("template", off, where=None, routing_weights=("off", "recorded"))):
        with pytest.raises(ConfigError, match="needs replay_mode R2 or R3"):
            refuse()
