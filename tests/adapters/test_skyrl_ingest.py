"""SkyRL adapter, ingest level, with SkyRL 0.3.0's real modules (preprocess, TrainingInputBatch).

Stubbed: nothing of SkyRL. Its package ``__init__`` chain fails on Python 3.11 (pydantic
TypedDict), so modules are loaded through ``r3bridge.adapters.skyrl._compat.import_skyrl``
(``skyrl.backends`` registered as a bare package; every module file is SkyRL's own). The only
stand-in is a tokenizer object with ``pad_token_id`` (all ``convert_prompts_responses_to_batch_tensors``
reads). vLLM is represented by its exact output formats (``wire``).
"""
from __future__ import annotations

import _skyrl_fixture as sk
import numpy as np
import pytest
import torch

from r3bridge import ReplayBatch
from r3bridge.adapters.skyrl.codec import MASK_KEY, ROUTES_KEY, handed_routes, training_batch_fields
from r3bridge.adapters.skyrl.rollout import merge_first_seen
from r3bridge.engines.decoders import decode_vllm_routes as decode_routed_experts
from r3bridge.errors import ConfigError, LayerMappingError, PayloadError, RouteShapeError, RouteValueError
from r3bridge.rollout.stitching import rollout_routes
from r3bridge.testing.kit.conformance import check_ingest, check_recorded_survives_split, make_rollout
from r3bridge.testing.kit.suite import BaseIngestTests

make_router_padding_mask = sk.make_router_padding_mask     # SkyRL main's (0.3.0 lacks it): test-side


class TestSkyRLIngest(BaseIngestTests, sk.SkyRLFixtures):
    """Conformance checks 1-3 on SkyRL's own batches and micro-batching."""


def _arr(rows, layers=4, k=2, seed=0, dtype=np.uint8):
    rng = np.random.default_rng(seed)
    return np.argsort(-rng.random((rows, layers, 8)), axis=-1)[..., :k].astype(dtype)


@pytest.mark.parametrize("transport", ["json", "npy_b64", "ndarray"])
def test_decode_every_transport(transport):
    a = _arr(5)
    got = decode_routed_experts(sk.wire(a, transport))
    assert got.shape == (5, 4, 2) and np.array_equal(got, a)


def test_decode_uint16_and_errors():
    a = _arr(3, dtype=np.uint16) + 300
    assert np.array_equal(decode_routed_experts(sk.wire(a, "npy_b64")), a)
    with pytest.raises(PayloadError, match="aborted request"):
        decode_routed_experts(None)
    with pytest.raises(PayloadError, match="base64"):
        decode_routed_experts("not base64 !!")
    with pytest.raises(RouteShapeError):
        decode_routed_experts([[1, 2], [3, 4]])


def test_first_seen_beats_skyrl_last_seen_overwrite():
    """Turn 2's prefill re-routes turn 1's tokens differently; SkyRL 0.3.0 keeps turn 2's rows."""
    t1, t2 = _arr(6, seed=1), _arr(10, seed=2)
    rb = rollout_routes([[sk.wire(t1, "json"), sk.wire(t2, "json")]], num_experts=8, moe_layer_ids=[1, 2, 3])
    r, v = rb.sequence(0)
    assert rb.rows_per_seq == [10] and bool(v.all()) and rb.route_kind == "rollout"
    assert torch.equal(r[:6], torch.from_numpy(t1[:, 1:]))       # first-seen: the rows that sampled
    assert torch.equal(r[6:], torch.from_numpy(t2[6:, 1:]))
    skyrl_overwrite = ReplayBatch.from_ragged([t2[:, 1:]], num_experts=8, layer_ids=[1, 2, 3])
    assert not torch.equal(skyrl_overwrite.routes[:6], r[:6])
    merged = merge_first_seen(merge_first_seen(None, t1.tolist()), t2.tolist())
    assert np.array_equal(np.asarray(merged), np.concatenate([t1, t2[6:]]))


def test_rollout_routes_report_and_start_rows():
    t1, t2 = _arr(6, seed=1), _arr(4, seed=2)
    rep = []
    rb = rollout_routes([[t1, t2]], num_experts=8, moe_layer_ids=[1, 2, 3], start_rows=[[0, 6]], report=rep)
    assert rb.rows_per_seq == [10] and rep[0].overlap_rows == [0]
    with pytest.raises(PayloadError):
        rollout_routes([[]], num_experts=8, moe_layer_ids=[1, 2, 3])


@pytest.mark.parametrize("fmt", ["0.3.0", "main"])
@pytest.mark.parametrize("transport", ["json", "npy_b64", "ndarray"])
def test_conformance_ingest(fmt, transport):
    for seed in range(4):
        rollout = make_rollout(seed)
        batch = sk.training_batch(rollout, fmt=fmt, transport=transport)
        check_ingest(sk.codec(rollout), batch, rollout, f"skyrl {fmt} {transport} seed {seed}")


def test_skyrl_own_accumulation_is_not_canonical():
    """The same rollout with SkyRL 0.3.0's overwrite differs from the canonical routes."""
    rollout = make_rollout(3)
    batch = sk.training_batch(rollout, first_seen=False)
    got = sk.codec(rollout).to_replay_batch(batch)
    assert got.to_bytes() != rollout.expected().to_bytes()


def test_conformance_recorded_survives_split():
    rollout = make_rollout(5, batch_size=6, num_experts=8)
    batch = sk.training_batch(rollout)
    codec = sk.codec(rollout)
    g = torch.Generator().manual_seed(0)
    lens = codec.seq_lens(batch)
    rec = ReplayBatch.from_ragged([torch.rand(n, 3, 8, generator=g).topk(2, -1).indices for n in lens],
                                  num_experts=8, layer_ids=[1, 2, 3], route_kind="recorded")
    n = check_recorded_survives_split(codec, batch, rec, parts=(1, 2, 4), orders=(None, [5, 3, 1, 0, 2, 4]))
    assert n == 2 * (1 + 2 + 3)          # 6 samples in chunks of ceil(6/4) = 2: 3 parts
    assert batch.metadata["r3bridge_routes"] == "recorded"


def test_router_padding_mask_matches_skyrl_main_semantics():
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    m = make_router_padding_mask(attn, [2, 5])
    assert m.tolist() == [[True, True, False, False, True], [False] * 5]
    with pytest.raises(RouteShapeError):
        make_router_padding_mask(attn, [4, 5])


def test_training_fields_roundtrip_left_padded():
    attn = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    g = torch.Generator().manual_seed(1)
    rec = ReplayBatch.from_ragged([torch.rand(n, 2, 8, generator=g).topk(2, -1).indices for n in (4, 6)],
                                  num_experts=8, layer_ids=[1, 3], route_kind="recorded")
    f = training_batch_fields(rec, attn, num_hidden_layers=4)
    assert f[ROUTES_KEY].shape == (2, 6, 4, 2) and f[ROUTES_KEY].dtype == torch.uint8
    assert f[ROUTES_KEY][0, 0, 0].tolist() == [0, 1]                 # dummy rows 0..K-1, never zero rows
    back = handed_routes({**f, "attention_mask": attn}, num_experts=8, moe_layer_ids=[1, 3],
                         route_kind="recorded").to_batch()
    assert back.to_bytes() == rec.to_bytes()


def test_trainer_side_errors():
    attn = torch.ones(1, 4, dtype=torch.long)
    routes = torch.zeros(1, 4, 4, 2, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="rollout_expert_indices"):
        handed_routes({"attention_mask": attn}, num_experts=8, moe_layer_ids=[1]).to_batch()
    with pytest.raises(LayerMappingError, match="num_hidden_layers"):
        handed_routes({ROUTES_KEY: routes, "attention_mask": attn}, num_experts=8,
                      moe_layer_ids=[1], num_hidden_layers=6).to_batch()
    with pytest.raises(ConfigError, match="sub_seq_lengths"):
        handed_routes({ROUTES_KEY: routes, "attention_mask": attn, "sub_seq_lengths": [[2, 2]]},
                      num_experts=8, moe_layer_ids=[1]).to_batch()
    bad = routes.clone()
    bad[0, :3, 1] = torch.tensor([3, 3], dtype=torch.uint8)          # duplicate ids in a real row
    with pytest.raises(RouteValueError, match="duplicate"):
        handed_routes({ROUTES_KEY: bad, "attention_mask": attn}, num_experts=8, moe_layer_ids=[1]).to_batch()


def test_zero_rows_without_mask_are_invalid_and_k1_counts_expert0_as_missing():
    attn = torch.ones(1, 3, dtype=torch.long)
    r = torch.zeros(1, 3, 2, 2, dtype=torch.uint8)
    r[0, 0, 1] = torch.tensor([2, 5])
    rb = handed_routes({ROUTES_KEY: r, "attention_mask": attn}, num_experts=8, moe_layer_ids=[1]).to_batch()
    assert rb.rows_per_seq == [2] and rb.valid.tolist() == [True, False]   # final invalid row dropped
    # with a mask, a row the mask calls captured must hold a real route: zeros are refused loudly
    with_mask = {ROUTES_KEY: r, "attention_mask": attn, MASK_KEY: torch.tensor([[False, False, True]])}
    with pytest.raises(RouteValueError, match="duplicate"):
        handed_routes(with_mask, num_experts=8, moe_layer_ids=[1]).to_batch()
    k1 = torch.zeros(1, 3, 2, 1, dtype=torch.uint8)
    k1[0, 1, 1] = 4
    rb3 = handed_routes({ROUTES_KEY: k1, "attention_mask": attn}, num_experts=8, moe_layer_ids=[1]).to_batch()
    assert rb3.valid.tolist() == [False, True]        # K == 1: expert 0 reads as "no route" (as in verl)


def test_r2_update_through_skyrl_padding_microbatch():
    # Token-based micro-batching pads with SkyRL's own dummy micro-batch (zero routes, first token
    # "real") and SkyRL 0.3.0's worker drops router_padding_mask: its zero row is no route, not a
    # recorded [0, 0] (that raised "duplicate expert ids").
    from r3bridge.adapters.skyrl._compat import import_skyrl
    wu = import_skyrl("skyrl.backends.skyrl_train.workers.worker_utils")
    tb = import_skyrl("skyrl.backends.skyrl_train.training_batch")
    b, s, k, e = 3, 8, 2, 8
    attn = torch.zeros(b, s, dtype=torch.long)
    for i, n in enumerate([8, 5, 3]):
        attn[i, s - n:] = 1
    g = torch.Generator().manual_seed(0)
    rec = ReplayBatch.from_ragged([torch.rand(n, 3, e, generator=g).topk(k, -1).indices for n in [8, 5, 3]],
                                  num_experts=e, layer_ids=[1, 2, 3], route_kind="recorded")
    zeros = torch.zeros(b, 4)
    data = tb.TrainingInputBatch({"sequences": torch.randint(1, 50, (b, s)), "attention_mask": attn,
                                  "action_log_probs": zeros, "base_action_log_probs": zeros, "values": zeros,
                                  "returns": zeros, "advantages": zeros, "loss_mask": zeros.long(),
                                  "response_mask": zeros.long(),
                                  **training_batch_fields(rec, attn, num_hidden_layers=4)})
    data.metadata = {"response_length": 4}
    it = wu.TokenBasedBatchIterator.__new__(wu.TokenBasedBatchIterator)
    it.data = data
    pad = it._create_padding_microbatch()
    assert pad[ROUTES_KEY].abs().sum() == 0 and pad["attention_mask"].sum() > 0
    got = handed_routes({ROUTES_KEY: pad[ROUTES_KEY].to(torch.int32),
                         "attention_mask": pad["attention_mask"]},
                        num_experts=e, moe_layer_ids=[1, 2, 3], route_kind="recorded").to_batch()
    assert not bool(got.valid.any())
    # the real samples' recorded routes still come back whole, without the mask as well
    real = handed_routes({ROUTES_KEY: data[ROUTES_KEY], "attention_mask": attn},
                         num_experts=e, moe_layer_ids=[1, 2, 3], route_kind="recorded").to_batch()
    assert real.equals(rec)
