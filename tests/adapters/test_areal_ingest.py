"""AReaL adapter, rollout + batch level, with AReaL 1.0.4's real data utilities and io structs.

Imports go through ``testlab.areal_env.import_areal`` (the adapter's importer, this
process's logging tree kept). The real ``RemoteInfEngine`` / ``SGLangBackend`` path runs in
tests/adapters/test_areal_real.py; ``tests/adapters/_areal_fixture.py`` reproduces the resubmit
loop and decode line for line (``StandInInfEngine``) against a fake SGLang server producing
SGLang's exact JSON.
"""
from __future__ import annotations

import asyncio
import base64
import importlib.util  # noqa: E402

import numpy as np
import pytest
import torch

assert importlib.util.find_spec("areal") is not None, "areal is not installed: run `make install`"

import _areal_fixture as ac  # noqa: E402

from r3bridge import ReplayBatch  # noqa: E402
from r3bridge.adapters.areal.attempts import RecordingBackend, decode_sglang, routes_from_attempts  # noqa: E402
from r3bridge.adapters.areal.codec import RECORDED_KEY, ROUTES_KEY, ArealCodec, batch_handed_routes  # noqa: E402
from r3bridge.adapters.areal.sequence_last import sequence_last_routes as trajectory_tensor  # noqa: E402
from r3bridge.errors import PayloadError, RouteValueError  # noqa: E402
from r3bridge.rollout.stitching import first_seen_rows  # noqa: E402
from r3bridge.testing.kit.conformance import check_ingest, check_recorded_survives_split, make_rollout  # noqa: E402
from r3bridge.testing.kit.suite import BaseIngestTests  # noqa: E402
from testlab.areal_env import import_areal  # noqa: E402


class TestArealIngest(BaseIngestTests, ac.ArealFixtures):
    """Conformance checks 1-3 on AReaL's own batches and micro-batching."""

data = import_areal("areal.utils.data")


def _meta(arr: np.ndarray, prompt: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": arr.shape[0] + 1 - prompt,
            "routed_experts": base64.b64encode(arr.astype("<i4").tobytes()).decode()}


def _arr(rows, seed, layers=4, k=2):
    rng = np.random.default_rng(seed)
    return np.argsort(-rng.random((rows, layers, 8)), axis=-1)[..., :k].astype(np.int32)


def test_decode_and_errors():
    a = _arr(6, 0)
    assert np.array_equal(decode_sglang(_meta(a, 3), num_layers=4, topk=2), a)
    with pytest.raises(PayloadError, match="prompt_tokens \\+ completion_tokens - 1"):
        decode_sglang({**_meta(a, 3), "completion_tokens": 9}, num_layers=4, topk=2)
    with pytest.raises(PayloadError, match="skip_tokenizer_init"):
        decode_sglang({"routed_experts": {}}, num_layers=4, topk=2)
    with pytest.raises(PayloadError, match="return_routed_experts"):
        decode_sglang({}, num_layers=4, topk=2)


def test_resubmit_dedupe_first_seen():
    """Attempt 2 of an interrupted request re-sends the prefix and gets all its rows again (re-routed)."""
    a1, a2 = _arr(7, 1), _arr(10, 2)
    rb = routes_from_attempts([_meta(a1, 4), _meta(a2, 8)], num_experts=8, num_layers=4, topk=2, moe_layer_ids=[1, 3])
    assert rb.rows_per_seq == [10]
    assert torch.equal(rb.routes[:7], torch.from_numpy(a1[:, [1, 3]]).to(torch.uint8))
    assert torch.equal(rb.routes[7:], torch.from_numpy(a2[7:, [1, 3]]).to(torch.uint8))
    rows, rep = first_seen_rows([a1.reshape(7, -1), a2.reshape(10, -1)])
    assert rows.shape == (10, 8) and rep.total_disagreeing == 7   # every overlapping row was re-routed differently
    areal_concat = np.concatenate([a1, a2])              # what AReaL 1.0.4 hands to the trainer
    assert areal_concat.shape[0] == 17 != 10


def test_engine_mixin_dedupes_real_modelresponse():
    rollout = make_rollout(2, batch_size=3)              # sample 2 has a resubmitted request
    i = 2
    inner = ac.StandInInfEngine(ac.FakeSGLang(rollout, i))
    plain = asyncio.run(inner.agenerate(type("R", (), {"input_ids": rollout.call_tokens[i][0][:rollout.call_prompt_lens[i][0]]})()))
    fixed = asyncio.run(ac.R3SGLang(ac.StandInInfEngine(ac.FakeSGLang(rollout, i))).agenerate(
        type("R", (), {"input_ids": rollout.call_tokens[i][0][:rollout.call_prompt_lens[i][0]]})()))
    io = import_areal("areal.api.io_struct")
    assert isinstance(fixed, io.ModelResponse)
    n = len(fixed.input_tokens) + len(fixed.output_tokens) - 1
    assert fixed.routed_experts.shape[0] == n < plain.routed_experts.shape[0]
    assert fixed.r3bridge_resubmits == 1
    eng = ac.R3SGLang(ac.StandInInfEngine(ac.FakeSGLang(rollout, i)))
    asyncio.run(eng.agenerate(type("R", (), {"input_ids": rollout.call_tokens[i][0][:rollout.call_prompt_lens[i][0]]})()))
    assert isinstance(eng._engine.backend, RecordingBackend)      # installed on the instance, lazily


def test_concurrent_requests_do_not_mix_attempts():
    rollout = make_rollout(4, batch_size=4)

    async def both():
        engines = [ac.R3SGLang(ac.StandInInfEngine(ac.FakeSGLang(rollout, i))) for i in range(4)]
        reqs = [type("R", (), {"input_ids": rollout.call_tokens[i][0][:rollout.call_prompt_lens[i][0]]})() for i in range(4)]
        return await asyncio.gather(*[e.agenerate(r) for e, r in zip(engines, reqs)])
    for resp in asyncio.run(both()):
        assert resp.routed_experts.shape[0] == len(resp.input_tokens) + len(resp.output_tokens) - 1


@pytest.mark.parametrize("seed", range(5))
def test_conformance_ingest(seed):
    rollout = make_rollout(seed)
    check_ingest(ArealCodec(ac.model_info(rollout)), ac.batch(rollout), rollout, f"areal seed {seed}")


def test_areal_own_concatenation_is_not_canonical():
    rollout = make_rollout(2)
    with pytest.raises(AssertionError, match="differ"):
        check_ingest(ArealCodec(ac.model_info(rollout)), ac.batch(rollout, dedupe=False), rollout)


def test_routes_survive_areal_unpad_and_concat():
    """compute_logp / compute_advantages split the batch back per trajectory with
    ``split_and_unpad_tensor`` (trims the *last* dim) and ppo_update concatenates again."""
    rollout = make_rollout(7)
    trajs = ac.trajectories(rollout)
    batched, meta = data.concat_batch(trajs)
    back = data.split_batch(batched, meta)
    again = data.concat_padded_tensors(back)
    codec = ArealCodec(ac.model_info(rollout))
    assert codec.to_replay_batch(again).to_bytes() == rollout.expected().to_bytes()


def test_conformance_recorded_survives_split():
    rollout = make_rollout(9, batch_size=6, num_experts=8)
    batch = ac.batch(rollout)
    codec = ArealCodec(ac.model_info(rollout))
    g = torch.Generator().manual_seed(0)
    rec = ReplayBatch.from_ragged([torch.rand(n, 3, 8, generator=g).topk(2, -1).indices for n in codec.seq_lens(batch)],
                                  num_experts=8, layer_ids=[1, 2, 3], route_kind="recorded")
    assert check_recorded_survives_split(codec, batch, rec, parts=(1, 2, 3)) >= 3
    assert batch[RECORDED_KEY].shape[:3] == (6, 3, 2)


def test_trajectory_tensor_sentinel_and_dtypes():
    rb = ReplayBatch.from_ragged([torch.tensor([[[1, 2]], [[3, 4]], [[0, 1]]])], num_experts=8, layer_ids=[2],
                                 valid=[[True, False, True]])
    t = trajectory_tensor(rb, [4])
    assert t.dtype == torch.uint8 and t.shape == (1, 1, 2, 4)
    assert t[0, 0, :, 1].tolist() == [255, 255] and t[0, 0, :, 3].tolist() == [255, 255]
    back = batch_handed_routes({ROUTES_KEY: t, "attention_mask": torch.ones(1, 4, dtype=torch.bool)},
                               key=ROUTES_KEY, num_experts=8, moe_layer_ids=[2]).to_batch()
    assert back.rows_per_seq == [3] and back.valid.tolist() == [True, False, True]
    big = ReplayBatch.from_ragged([torch.tensor([[[300, 2]]])], num_experts=512, layer_ids=[0])
    assert trajectory_tensor(big, [1]).dtype == torch.int16
    edge = ReplayBatch.from_ragged([torch.tensor([[[254, 2]]])], num_experts=255, layer_ids=[0])
    assert trajectory_tensor(edge, [2]).dtype == torch.uint8 and int(trajectory_tensor(edge, [2])[0, 0, 0, 1]) == 255


def test_parent_concat_keeps_only_agreeing_prefix():
    """A child turn whose prompt drops the parent's stop token: parent rows past the divergence are
    not the child's tokens and must not be replayed."""
    io = import_areal("areal.api.io_struct")
    from r3bridge.adapters.areal.rollout import routes_from_responses
    parent_tokens = [5, 6, 7, 8, 99]                  # 99: stop token, stripped in the child
    child_prompt = [5, 6, 7, 8, 11, 12]
    a_parent, a_child = _arr(4, 3), _arr(8, 4)
    p = io.ModelResponse(input_tokens=parent_tokens[:3], output_tokens=parent_tokens[3:], routed_experts=a_parent.reshape(4, -1))
    c = io.ModelResponse(input_tokens=child_prompt, output_tokens=[13, 14, 15], routed_experts=a_child.reshape(8, -1))
    stitched = routes_from_responses([p, c], child_prompt + [13, 14, 15], num_experts=8, num_layers=4, topk=2,
                                     moe_layer_ids=[1, 2, 3])
    rb = stitched.routes
    assert rb.rows_per_seq == [8] and bool(rb.valid.all())
    # the child re-prefilled the parent's 4 kept rows: counted, and those that differ counted too
    differ = int((a_parent != a_child[:4]).reshape(4, -1).any(1).sum())
    assert (stitched.overlap_rows, stitched.disagreeing_rows) == (4, differ) and differ > 0
    assert torch.equal(rb.routes[:4], torch.from_numpy(a_parent[:, 1:]).to(torch.uint8))     # first-seen
    assert torch.equal(rb.routes[4:], torch.from_numpy(a_child[4:, 1:]).to(torch.uint8))
    with pytest.raises(PayloadError, match="no routed_experts"):
        routes_from_responses([io.ModelResponse(input_tokens=[1], output_tokens=[2])], [1, 2], num_experts=8,
                              num_layers=4, topk=2, moe_layer_ids=[1])


def test_a_bad_id_in_a_row_a_later_turn_repeats_is_refused_naming_the_sample_and_turn():
    """First-seen stitching replays the parent's rows; the child's copy of them is not replayed, but
    an id out of range there is still bad input: refused, not dropped because another turn came first."""
    io = import_areal("areal.api.io_struct")
    from r3bridge.adapters.areal.rollout import routes_from_responses
    a_parent, a_child = _arr(4, 3), _arr(8, 4)
    a_child[2, 1, 0] = 8                               # 8 experts: ids 0..7; row 2 is the parent's row too
    p = io.ModelResponse(input_tokens=[5, 6, 7], output_tokens=[8, 99], routed_experts=a_parent.reshape(4, -1))
    c = io.ModelResponse(input_tokens=[5, 6, 7, 8, 11, 12], output_tokens=[13, 14, 15],
                         routed_experts=a_child.reshape(8, -1))
    with pytest.raises(RouteValueError, match=r"AReaL sample index=3, turn 1.*row 2"):
        routes_from_responses([p, c], [5, 6, 7, 8, 11, 12, 13, 14, 15], num_experts=8, num_layers=4, topk=2,
                              moe_layer_ids=[1, 2, 3], sample="index=3")
