"""``adapters/_template`` is a working skeleton: a toy framework built from it passes conformance
checks 1-5, through the template's own test module (``adapters/_template/conformance_tests.py``,
what ``r3bridge new-adapter`` copies into every new adapter), collected here."""
from __future__ import annotations

import pytest

from r3bridge.adapters._template import RECORDED_KEY, TemplateCodec
from r3bridge.adapters._template.conformance_tests import (  # noqa: F401  (collected by pytest)
    R3ToyEngine,
    TemplateRunner,
    TestTemplateIngest,
    TestTemplateMegatron,
    framework_batch,
)
from r3bridge.testing.kit.conformance import check_ingest
from r3bridge.testing.kit.rollouts import CanonicalRollout, make_rollout


def test_last_seen_batch_fails_check_ingest():
    """The check can fail: a batch built from each sample's *last* call (the overwrite bug)."""
    rollout = make_rollout(1, batch_size=6)
    assert any(len(c) > 1 for c in rollout.calls)
    last = CanonicalRollout(rollout.tokens, [c[-1:] for c in rollout.calls], rollout.call_tokens, rollout.prompt_lens,
                            rollout.call_prompt_lens, rollout.num_experts, rollout.num_layers, rollout.moe_layer_ids,
                            rollout.topk)
    codec = TemplateCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                          num_hidden_layers=rollout.num_layers, topk=rollout.topk)
    with pytest.raises(AssertionError, match="differ"):
        check_ingest(codec, framework_batch(last), rollout)


def test_a_micro_batch_of_aborted_samples_keeps_the_models_topk_or_is_named():
    """Aborted samples (routes=None) give a micro-batch without one valid row: the template codec
    reads it with the model's top-k; routes of another top-k are refused at install naming the
    micro-batch, its samples and the cause (was: "layer 1: target top-k 1 != router top-k 2" at
    the first router call)."""
    import numpy as np

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.errors import ReplayStateError, RouteShapeError
    from r3bridge.megatron.replay_pass import _check_topk

    rollout = make_rollout(2, batch_size=6, aborted=(4, 5))
    codec = TemplateCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                          num_hidden_layers=rollout.num_layers, topk=rollout.topk)
    batch = framework_batch(rollout)
    part = {k: v[[4, 5]] for k, v in batch.items()}
    read = codec.to_replay_batch(part)
    assert read.topk == rollout.topk and not bool(read.valid.any())
    _check_topk(read, rollout.topk, "chunk 0, micro-batch 2 (samples [4, 5])")
    with pytest.raises(RouteShapeError, match="carries 1 expert ids per token and layer, the model routes top-2"):
        codec.to_replay_batch({**part, "routed_experts": part["routed_experts"][..., :1]})
    shapeless = ReplayBatch.from_ragged([np.zeros((3, 3, 1), dtype=np.uint8)] * 2, num_experts=4, layer_ids=[1, 2, 3],
                                        valid=[[False] * 3] * 2)
    with pytest.raises(ReplayStateError, match=r"chunk 0, micro-batch 2 \(samples \[4, 5\]\): routes of top-1, the "
                                               r"model's routers choose top-2 and not one valid row: .*aborted"):
        _check_topk(shapeless, 2, "chunk 0, micro-batch 2 (samples [4, 5])")


class ShuffledRecordingEngine(R3ToyEngine):
    """An adapter whose ``update`` override is broken on purpose: each sample replays the previous
    sample's recorded routes (the R2 sample index off by one)."""

    def update(self, batch, groups):
        return super().update({**batch, RECORDED_KEY: batch[RECORDED_KEY].roll(1, 0)}, groups)


class ShuffledRecordingRunner(TemplateRunner):
    engine_class = ShuffledRecordingEngine


@pytest.mark.slow
def test_a_broken_update_override_fails_check5():
    """Checks 4-5 run the adapter's own phase methods (the template's runner calls ``update``, not
    the schedule): a broken ``update`` override fails check 5, while check 4 (compute_log_prob)
    still passes. A runner that called ``forward_backward`` directly never ran the override."""
    from r3bridge.testing.kit.conformance import (
        ONE_RANK,
        MegatronCase,
        assert_r2_passes,
        assert_r3_passes,
        run_megatron_checks,
    )

    (result,) = run_megatron_checks(MegatronCase(ShuffledRecordingRunner, aborted=(4, 5)), ONE_RANK, timeout=600)
    assert_r3_passes(result)
    with pytest.raises(AssertionError, match="check 5 on 1 rank"):
        assert_r2_passes(result)
