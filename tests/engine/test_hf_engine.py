"""The HF transformers rollout engine on its own (no Megatron): token bookkeeping of generate()
against an independent full-sequence forward, both engine formats, the rollout kinds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from r3bridge import ReplayBatch
from r3bridge.demo.hf_engine import HFEngine, build_hf_model, tiny_deepseek_v3_config, tiny_qwen3_moe_config
from testlab.hf_checks import hf_logprobs, run_rollout


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine(build_hf_model(tiny_qwen3_moe_config(), seed=7))


@pytest.fixture(scope="module")
def batch(engine):
    g = np.random.default_rng(1)
    prompts = [g.integers(1, 256, size=n).tolist() for n in (5, 23, 12)]
    return prompts, engine.generate(prompts, max_new_tokens=[17, 9, 30], seed=3)


def _sets(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.int64)).sort(-1).values


def test_rows_are_prompt_plus_generated_minus_one_dense_layer_zero(engine, batch):
    prompts, out = batch
    for p, c, limit in zip(prompts, out, (17, 9, 30)):
        assert c.prompt_ids == p and len(c.output_ids) == limit and c.finish_reason == "length"
        assert c.routed_experts.dtype == np.uint8
        assert c.routed_experts.shape == (len(p) + limit - 1, 4, 2)
        assert not c.routed_experts[:, 0].any()                  # layer 0 is dense (mlp_only_layers)
        moe = c.routed_experts[:, 1:]
        assert (moe[..., 0] != moe[..., 1]).all()                # distinct experts per row
    assert engine.moe_layer_ids == [1, 2, 3]


def test_each_row_is_the_route_of_that_token(engine, batch):
    """Row r of a request = the experts chosen for token r: a full-sequence forward of the final
    tokens (no padding, no cache) picks the same sets. An off-by-one in the prefill / decode
    bookkeeping or in the left-padding offset would agree on ~1/28 of the rows."""
    prompts, out = batch
    for c in out:
        lp, ref = hf_logprobs(engine.model, c.tokens)
        for lid in engine.moe_layer_ids:
            want = _sets(ref[lid][:-1])
            got = _sets(c.routed_experts[:, lid])
            assert float((got == want).all(-1).float().mean()) > 0.97, lid
        # the engine's log-probs are those of the sampled tokens under the same model
        gen = torch.tensor(c.logprobs)
        assert torch.allclose(gen, lp[len(c.prompt_ids) - 1:], atol=1e-4)


def test_left_padding_does_not_change_a_request(engine, batch):
    prompts, out = batch
    alone = engine.generate([prompts[0]], max_new_tokens=1, seed=0)[0]
    # the prompt rows (prefill) of the shortest prompt, batched behind 18 pad tokens before
    n = len(prompts[0])
    assert np.array_equal(_sets(alone.routed_experts[:n]), _sets(out[0].routed_experts[:n]))


def test_vllm_and_sglang_formats_give_the_same_batch(engine, batch):
    _, out = batch
    a = ReplayBatch.from_vllm([c.routed_experts for c in out], num_experts=8, moe_layer_ids=engine.moe_layer_ids)
    b = ReplayBatch.from_sglang([c.meta_info() for c in out], num_experts=8, num_layers=4, topk=2,
                                moe_layer_ids=engine.moe_layer_ids)
    assert torch.equal(a.routes, b.routes) and a.rows_per_seq == b.rows_per_seq
    assert a.rows_per_seq == [len(c.tokens) - 1 for c in out]


def test_eos_stops_a_request_and_cuts_its_rows(engine):
    prompts = [[3, 4, 5, 6], [7, 8]]
    free = engine.generate(prompts, max_new_tokens=12, seed=5)
    eos = free[0].output_ids[4]                       # a token request 0 samples at step 5
    out = engine.generate(prompts, max_new_tokens=12, seed=5, eos_token_id=eos)
    c = out[0]
    assert c.finish_reason == "stop" and c.output_ids[-1] == eos
    assert len(c.output_ids) == c.output_ids.index(eos) + 1 <= 5
    assert c.routed_experts.shape[0] == len(c.tokens) - 1


def test_rollout_kinds_stitch_first_seen_and_leave_untracked_tails_invalid(engine):
    ro = run_rollout(engine)
    rb = ro.routes
    assert rb.rows_per_seq == [len(t) - 1 for t in ro.tokens]
    assert ro.stitch_overlap > 0                      # multi-turn prefill + resubmitted prefix
    for i, kind in enumerate(ro.kinds):
        _, v = rb.sequence(i)
        if kind == "untracked_tail":                  # the last 6 tokens were never routed
            assert v[:-6].all() and not v[-6:].any()
        elif kind == "multi_turn":                    # every token but the last went through a call
            assert v.all()
        else:
            assert v.all()
        # trained tokens are exactly the sampled ones, with engine log-probs
        assert int(ro.trained[i].sum()) == int((ro.engine_logprobs[i] != 0).sum())


def test_deepseek_v3_style_routes_are_the_hf_choice_with_bias_and_groups():
    """First-k-dense, sigmoid scores, expert bias, group-limited top-k: the engine reports what the
    HF block chose (no routing re-implemented): a large bias on expert 5 puts it in every row, and
    both experts of a row come from the single selected group (n_group=2, topk_group=1)."""
    model = build_hf_model(tiny_deepseek_v3_config(), seed=2)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias[5] = 10.0
    eng = HFEngine(model)
    assert eng.moe_layer_ids == [1, 2, 3]
    out = eng.generate([[5, 6, 7, 8, 9], [10, 11]], max_new_tokens=[6, 4], seed=1)
    for c in out:
        r = c.routed_experts
        assert r.shape == (len(c.tokens) - 1, 4, 2) and not r[:, 0].any()
        assert (r[:, 1:] == 5).any(-1).all()
        assert (r[:, 1:] // 4 == 1).all()             # experts 4..7: group 1
