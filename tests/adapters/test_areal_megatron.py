"""AReaL adapter on a real megatron-core model (CPU harness), conformance checks 4 and 5
(:class:`r3bridge.testing.kit.suite.BaseMegatronTests`).

``MegatronEngine`` itself cannot be imported here (``mbridge``, and ``areal.infra``'s OpenAI
stack), so the engine is ``tests/adapters/_areal_fixture.StandInMegatronEngine``: its
``_prepare_mb_list`` / ``forward_backward_batch`` for text models, calling AReaL's real
``amend_position_ids``, ``split_padded_tensor_dict_into_mb_list`` (token-balanced, reorders
samples), ``pack_tensor_dict``, ``pad_mb_list`` (per-sequence alignment + a trailing page-padding
"sequence"), ``packed_context_parallel_forward`` and ``unpad_logits``, in AReaL's order. The actor
is ``PPOActor``'s ``compute_logp`` / ``ppo_update`` batching (``batched_call``). r3bridge's
``MegatronEngineMixin`` / ``PPOActorMixin`` are mixed in exactly as in a real job.
Test-only: the harness GPT's learned position embeddings are switched off (AReaL models use RoPE
and feed un-split ``position_ids`` under CP).
"""
from __future__ import annotations

import importlib.util

import pytest

from r3bridge.testing.kit.suite import BaseMegatronTests

assert importlib.util.find_spec("areal") is not None, "areal is not installed: run `make install`"

from _areal_fixture import ArealFixtures  # noqa: E402


@pytest.mark.slow
class TestArealMegatron(BaseMegatronTests, ArealFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def reader_form(cls):
        return "sequence_last/sentinel/rollout"      # the one reader reads this adapter's own buffer, per micro-batch

    def test_metrics_reach_areal_stats_tracker(self, megatron_results):
        for result in megatron_results:
            for r in result.ranks:
                # the update's driver metrics reach AReaL's stats tracker, tagged by phase
                logged = r["r2"]["framework_metrics"]
                assert logged["r3bridge/update/agreement/mean"] == pytest.approx(1.0), logged
                assert logged["r3bridge/update/coverage"] == pytest.approx(r["r2"]["metrics"]["r3bridge/coverage"])
