"""AReaL adapter on a real megatron-core model (CPU harness), conformance checks 4 and 5.

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

assert importlib.util.find_spec("areal") is not None, "areal is not installed: run `make install`"


def _cell(ctx):
    from _areal_fixture import ArealRunner
    from _megatron_checks import run_checks

    return run_checks(ctx, lambda rollout: ArealRunner())


@pytest.mark.slow
def test_areal_engine_replays_exactly():
    from _megatron_checks import spawn_and_check

    for per_rank in spawn_and_check(_cell):
        for r in per_rank:
            # the update's driver metrics reach AReaL's stats tracker, tagged by phase
            logged = r["r2"]["framework_metrics"]
            assert logged["r3bridge/update/agreement/mean"] == pytest.approx(1.0), logged
            assert logged["r3bridge/update/coverage"] == pytest.approx(r["r2"]["metrics"]["r3bridge/coverage"])
