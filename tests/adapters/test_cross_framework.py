"""One rollout (same tokens, same engine routes) through the verl, SkyRL and AReaL ingest paths:
byte-identical ReplayBatches and identical per-rank targets for several parallel layouts.

* verl 0.9.1: the padded ``routed_experts`` its agent loop builds (engine rows placed from the
  prompt start, zero rows elsewhere), converted by verl's own ``left_right_2_no_padding`` into the
  nested jagged TensorDict field, read by ``r3bridge.adapters.verl.codec.handed_routes``
  (the verl adapter's ingest function);
* SkyRL 0.3.0: every vLLM call's payload (SkyRL's JSON lists) accumulated first-seen, then SkyRL's
  own ``convert_prompts_responses_to_batch_tensors`` -> ``TrainingInputBatch`` -> the SkyRL codec;
* AReaL 1.0.4: SGLang's base64 ``meta_info`` per attempt (fake server), resubmits deduplicated,
  turns stitched parent-concat, trajectories concatenated by AReaL's ``concat_padded_tensors`` ->
  the AReaL codec.

verl's multi-turn agent loop does not stitch turns itself; its input here is the first-seen
stitched all-layers array (what r3bridge asks of any rollout), so the verl leg checks verl's
transport and ingest, the SkyRL and AReaL legs also check their stitching and dedupe.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from _verl_batches import verl_batch

from r3bridge import ReplayBatch
from r3bridge.config import Phase, ReplayConfig, phase_plan
from r3bridge.testing.kit.conformance import assert_same_batch, check_same_targets, make_rollout

for mod in ("verl", "skyrl", "areal", "tensordict"):   # installed by `make install`: never skip
    assert importlib.util.find_spec(mod) is not None, f"{mod} is not installed: run `make install`"


def ingest_all(rollout) -> dict[str, ReplayBatch]:
    import _areal_fixture as ac
    import _skyrl_fixture as sk

    from r3bridge.adapters.areal import ArealCodec
    from r3bridge.adapters.verl.codec import handed_routes

    return {
        "verl": handed_routes(verl_batch(rollout), moe_layer_ids=rollout.moe_layer_ids,
                              num_experts=rollout.num_experts, route_kind="rollout",
                              num_hidden_layers=rollout.num_layers).to_batch(),
        "skyrl": sk.codec(rollout).to_replay_batch(sk.training_batch(rollout)),
        "skyrl_main": sk.codec(rollout).to_replay_batch(sk.training_batch(rollout, fmt="main", transport="npy_b64")),
        "areal": ArealCodec(ac.model_info(rollout)).to_replay_batch(ac.batch(rollout)),
    }


@pytest.mark.parametrize("seed", range(4))
def test_same_rollout_same_bytes(seed):
    rollout = make_rollout(seed, batch_size=6)
    batches = ingest_all(rollout)
    want = rollout.expected()
    for name, rb in batches.items():
        assert_same_batch(rb, want, name)
    assert len({rb.to_bytes() for rb in batches.values()}) == 1


def test_same_rollout_same_rank_targets():
    rollout = make_rollout(21, batch_size=6)
    batches = ingest_all(rollout)
    seq_lens = [len(t) for t in rollout.tokens]
    n = check_same_targets(batches, seq_lens)
    assert n > 20


def test_more_experts_than_uint8():
    """int16 ids (E > 256) through all three transports."""
    rollout = make_rollout(5, batch_size=4, num_experts=300, topk=4, dtype=np.uint16)
    batches = ingest_all(rollout)
    assert all(rb.routes.dtype == torch.int16 for rb in batches.values())
    assert len({rb.to_bytes() for rb in batches.values()}) == 1


def test_recorded_routes_same_in_every_framework():
    """R2: routes recorded by the trainer, written back in each framework's own layout, read back."""
    import _areal_fixture as ac
    import _skyrl_fixture as sk

    from r3bridge.adapters.areal import ArealCodec
    from r3bridge.adapters.verl.codec import handed_routes
    from r3bridge.adapters.verl.nested import nested_routes

    rollout = make_rollout(8, batch_size=5, num_experts=8)
    lens = [len(t) for t in rollout.tokens]
    g = torch.Generator().manual_seed(3)
    rec = ReplayBatch.from_ragged([torch.rand(n, 3, 8, generator=g).topk(2, -1).indices for n in lens],
                                  num_experts=8, layer_ids=[1, 2, 3], route_kind="recorded")
    td = verl_batch(rollout)
    td["routed_experts"] = nested_routes(rec)
    got = {"verl": handed_routes(td, moe_layer_ids=[1, 2, 3], num_experts=8, route_kind="recorded").to_batch()}
    sky = sk.codec(rollout)
    got["skyrl"] = sky.to_replay_batch(sky.write_recorded(sk.training_batch(rollout), rec), route_kind="recorded")
    ar = ArealCodec(ac.model_info(rollout))
    got["areal"] = ar.to_replay_batch(ar.write_recorded(ac.batch(rollout), rec), route_kind="recorded")
    for name, rb in got.items():
        assert_same_batch(rb, rec, name)


def test_same_replay_mode_key(monkeypatch):
    """Both adapters read the same ``r3bridge`` section (ReplayConfig) and plan phases alike."""
    # both adapters' mixins resolve their section with ReplayConfig.resolve (no adapter wrapper)
    skyrl_cfg = areal_cfg = ReplayConfig.resolve

    monkeypatch.setenv("R3BRIDGE_CONFIG", '{"replay_mode": "R2", "min_coverage": 0.5}')
    assert skyrl_cfg() == areal_cfg() == ReplayConfig(replay_mode="R2", min_coverage=0.5)
    monkeypatch.delenv("R3BRIDGE_CONFIG")
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "r3")
    assert skyrl_cfg().replay_mode == areal_cfg().replay_mode
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE")      # next to an explicit replay_mode it would clash
    for mode in ("off", "R2", "R3"):
        for phase in Phase:
            assert skyrl_cfg({"replay_mode": mode}).plan(phase) == areal_cfg({"replay_mode": mode}).plan(phase) \
                == phase_plan(mode, phase)


def test_verl_codec_checks_1_to_3():
    """verl's codec through the suite like the others: its own batch reads back canonical (1),
    R2 routes survive verl's own dynamic micro-batching, also after a permutation (2), and give
    the same rank targets as the canonical batch (3)."""
    from r3bridge.adapters.verl import VerlCodec
    from r3bridge.testing.kit.conformance import check_ingest, check_recorded_survives_split

    rollout = make_rollout(4, batch_size=6, num_experts=8)
    codec = VerlCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                      num_hidden_layers=rollout.num_layers)
    got = check_ingest(codec, verl_batch(rollout), rollout, "verl")
    lens = [len(t) for t in rollout.tokens]
    g = torch.Generator().manual_seed(5)
    rec = ReplayBatch.from_ragged([torch.rand(n, 3, 8, generator=g).topk(2, -1).indices for n in lens],
                                  num_experts=8, layer_ids=[1, 2, 3], route_kind="recorded")
    assert check_recorded_survives_split(codec, verl_batch(rollout), rec, parts=(1, 2, 3),
                                         orders=(None, [4, 2, 0, 5, 1, 3])) >= 2 * (1 + 2 + 3)
    assert check_same_targets({"verl": got, "canonical": rollout.expected()}, lens) > 0
