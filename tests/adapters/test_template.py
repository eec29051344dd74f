"""``adapters/_template`` is a working skeleton: a toy framework built from it passes conformance
checks 1-5, through the template's own test module (``adapters/_template/conformance_tests.py``,
what ``r3bridge new-adapter`` copies into every new adapter), collected here."""
from __future__ import annotations

import pytest

from r3bridge.adapters._template import TemplateCodec
from r3bridge.adapters._template.conformance_tests import (  # noqa: F401  (collected by pytest)
    TestTemplateIngest,
    TestTemplateMegatron,
    framework_batch,
)
from r3bridge.testing.conformance import check_ingest
from r3bridge.testing.rollouts import CanonicalRollout, make_rollout


def test_last_seen_batch_fails_check_ingest():
    """The check can fail: a batch built from each sample's *last* call (the overwrite bug)."""
    rollout = make_rollout(1, batch_size=6)
    assert any(len(c) > 1 for c in rollout.calls)
    last = CanonicalRollout(rollout.tokens, [c[-1:] for c in rollout.calls], rollout.call_tokens, rollout.prompt_lens,
                            rollout.call_prompt_lens, rollout.num_experts, rollout.num_layers, rollout.moe_layer_ids,
                            rollout.topk)
    codec = TemplateCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                          num_hidden_layers=rollout.num_layers)
    with pytest.raises(AssertionError, match="differ"):
        check_ingest(codec, framework_batch(last), rollout)
