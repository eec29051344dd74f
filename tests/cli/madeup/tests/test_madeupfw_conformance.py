"""Conformance checks 1-5 of the madeupfw adapter, run with ``python -m pytest`` in this project
(:mod:`r3bridge.testing.kit.suite`: checks 1-3 in seconds, checks 4-5 start CPU ranks of a real
megatron-core model: a few minutes).

The model is the made-up framework's: 6 decoder layers, layers 1 and 4 (0-based) dense, 4 experts,
top-2. :func:`framework_batch` builds madeup_framework's own batch from what its engine returned
for the kit's rollout (:func:`completions`: the engine's per-call format, MoE layers keyed
1-based, ``routes=None`` for the aborted samples); :class:`MadeupEngine` stands in for the
framework's Megatron engine (only its model-running body: the harness forward step).
"""
from __future__ import annotations

import pytest
import torch
from madeup_framework import LAYER_BASE, Completion, Trajectory, collate, select
from madeupfw import SAMPLE_KEY, MadeupfwCodec, MadeupfwEngineMixin, MadeupfwRollout

from r3bridge.batch.canonical import canonical_form
from r3bridge.config import Phase, ReplayConfig
from r3bridge.testing.kit.conformance import TWO_RANK, assert_same_batch
from r3bridge.testing.kit.rollouts import CanonicalRollout, ModelShape
from r3bridge.testing.kit.runner import align_for, pack_thd, record_packing, unpack_rows
from r3bridge.testing.kit.suite import AdapterFixtures, BaseIngestTests, BaseMegatronTests

SHAPE = ModelShape(num_experts=4, topk=2, num_layers=6, moe_layers=(0, 2, 3, 5))


# ---------------------------------------------------------------------------------- the framework's engine
def completions(rollout: CanonicalRollout, i: int) -> list[Completion]:
    """What madeup_framework's engine returned for sample ``i``: per call, its prompt and output,
    and its MoE layers' routes keyed by 1-based layer number (``None``: the call was aborted)."""
    out = []
    for call, tokens, plen in zip(rollout.calls[i], rollout.call_tokens[i], rollout.call_prompt_lens[i]):
        routes = None if call is None else {lid + LAYER_BASE: call[:, lid] for lid in rollout.moe_layer_ids}
        out.append(Completion(tokens[:plen], tokens[plen:], routes))
    return out


def framework_batch(rollout: CanonicalRollout) -> dict:
    """madeup_framework's training batch of the rollout, built by its own ``collate``."""
    return collate([Trajectory(list(t), completions(rollout, i)) for i, t in enumerate(rollout.tokens)])


class MadeupEngine:
    """madeup_framework's Megatron engine: packs each micro-batch (THD, alignment padding per
    sequence) and runs Megatron's schedule once per pass."""

    def __init__(self, chunks: list, ctx) -> None:
        self.chunks, self.ctx = chunks, ctx

    def forward_backward(self, micro_batches: list[dict], forward_only: bool = False):
        from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

        vocab = self.chunks[0].vocab_size
        align = align_for(self.ctx.tp, self.ctx.cp)
        self.packed = [pack_thd([ids[mask].tolist() for ids, mask in zip(mb["tokens"], mb["mask"].bool())],
                                vocab_size=vocab, align=align) for mb in micro_batches]
        return run_schedule(self.chunks, self.packed, make_forward_step(self.ctx, thd=True, collect_logits=True),
                            forward_only=forward_only)


class R3MadeupEngine(MadeupfwEngineMixin, MadeupEngine):
    """The adapter's mixin in front of the framework's engine, as in a real job."""


# ---------------------------------------------------------------------------------- the runner of checks 4-5
class MadeupfwRunner:
    """:class:`r3bridge.testing.kit.runner.MegatronRunner` of the adapter on madeup_framework's engine."""

    def __init__(self, rollout: CanonicalRollout) -> None:
        self.codec = MadeupfwCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                                   num_hidden_layers=rollout.num_layers, topk=rollout.topk)
        self.batch = framework_batch(rollout)

    def attach(self, ctx, chunks, mode):
        engine = R3MadeupEngine(chunks, ctx)
        engine.r3_config = ReplayConfig(replay_mode=mode)
        engine.r3_attach(chunks, self.codec)
        engine.replayer = engine.r3_runner.replayer
        return engine

    def micro_batches(self, rollout, groups, *, key):
        out = []
        for group in groups:
            mb = select(self.batch, group)                  # the framework's own selection
            mb[SAMPLE_KEY] = torch.tensor(list(group))
            out.append(mb)
        return out

    def run(self, engine, micro_batches, *, phase):
        engine.r3_phase = Phase(phase)
        for chunk in engine.chunks:
            chunk.eval()
        with record_packing(engine.chunks[0]) as packing:
            outputs = engine.forward_backward(micro_batches, forward_only=True)
        per_sample = [rows for out, packed in zip(outputs, engine.packed)     # last pipeline stage only
                      for rows in unpack_rows(out.logits, packed)]
        return {"logprobs": per_sample, "metrics": dict(engine.r3_result.metrics),
                "recorded": engine.r3_result.recorded, "packing": packing}

    def write_recorded(self, rollout, recorded):
        self.batch = self.codec.write_recorded(self.batch, recorded)


# ---------------------------------------------------------------------------------- checks 1-5
class MadeupfwFixtures(AdapterFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def model_shape(cls):
        return SHAPE

    @pytest.fixture
    def codec(self, rollout):
        return MadeupfwCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                             num_hidden_layers=rollout.num_layers, topk=rollout.topk)

    @pytest.fixture
    def native_batch(self, rollout):
        return framework_batch(rollout)

    @pytest.fixture(scope="class")
    @classmethod
    def aborted_samples(cls):
        return (4, 5)               # aborted engine calls; checks 4-5: micro-batch 2 holds only these two

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_runner(cls):
        return MadeupfwRunner

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls):
        # PP2 x VPP2, which the kit fits to 6 layers (PP2 x VPP3, said in a LayoutNote); add ONE_RANK
        # and the other CPU_LAYOUTS where test time allows
        return TWO_RANK[2:]


class TestMadeupfwIngest(BaseIngestTests, MadeupfwFixtures):
    """Checks 1-3, and the rollout side: the engine calls of each sample, stitched first-seen."""

    def test_rollout_ingest(self, rollout):
        ingest = MadeupfwRollout(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                                 topk=rollout.topk)
        read = canonical_form(ingest.routes_from_rollout([completions(rollout, i) for i in range(rollout.batch_size)]),
                              [len(t) for t in rollout.tokens])
        assert_same_batch(read, rollout.expected(), "MadeupfwRollout")


class TestMadeupfwMegatron(BaseMegatronTests, MadeupfwFixtures):
    """Checks 4-5."""
