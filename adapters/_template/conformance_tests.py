"""Conformance checks 1-5 of the <YourFramework> adapter, run with ``python -m pytest``
(:mod:`r3bridge.testing.kit.suite`: checks 1-3 in seconds, checks 4-5 start CPU ranks of a real
megatron-core model: a few minutes).

So that it runs as it is, "your framework" here is a toy one. Replace, in this order:

1. :func:`framework_batch`: the toy framework's training batch. Yours: the batch your framework
   builds *with its own code* from what its engine returned for the rollout;
2. :class:`ToyEngine`: the toy framework's engine, whose phase methods (``compute_log_prob``,
   ``update``) cut the batch into micro-batches and whose ``forward_backward`` packs each
   micro-batch (THD, alignment padding per sequence) and runs Megatron's schedule on the harness
   chunks. Yours: your framework's engine (or actor) class, with only the model-running body of
   its forward step stood in for (:mod:`r3bridge.testing.kit.runner` says how);
3. :class:`TemplateRunner`: the :class:`r3bridge.testing.kit.runner.MegatronRunner` checks 4-5
   drive: attach, cut micro-batches, run one pass *through the framework's phase method*, report.

The adapter's classes are used unchanged: ``TemplateEngineMixin`` is put in front of the engine
exactly as in a real job, so its ``compute_log_prob`` / ``update`` overrides (the phase, the
sample index, R2's write-back) run in checks 4-5: a broken override fails them.
"""
from __future__ import annotations

import pytest
import torch

from r3bridge.adapters._template import (
    ROUTES_KEY,
    VALID_KEY,
    TemplateCodec,
    TemplateEngineMixin,
    TemplateRollout,
)
from r3bridge.batch.canonical import canonical_form
from r3bridge.config import Phase, ReplayConfig
from r3bridge.rollout.stitching import first_seen_rows
from r3bridge.testing.kit.conformance import CPU_LAYOUTS, assert_same_batch
from r3bridge.testing.kit.rollouts import CanonicalRollout
from r3bridge.testing.kit.runner import align_for, pack_thd, record_packing, unpack_rows
from r3bridge.testing.kit.suite import AdapterFixtures, BaseIngestTests, BaseMegatronTests


# ---------------------------------------------------------------------------------- your framework
def framework_batch(rollout: CanonicalRollout) -> dict:
    """The toy framework's batch: each sample's engine calls stitched first-seen (every call
    starts at row 0 here), right-padded; ``VALID_KEY`` marks the tokens an engine call routed (none
    of an aborted sample, whose calls returned ``None``). The routes field has the model's top-k."""
    b, s = rollout.batch_size, max(len(t) for t in rollout.tokens)
    batch = {"input_ids": torch.zeros(b, s, dtype=torch.int64), "attention_mask": torch.zeros(b, s, dtype=torch.bool),
             ROUTES_KEY: torch.zeros(b, s, rollout.num_layers, rollout.topk, dtype=torch.int32)}
    valid = torch.zeros(b, s, dtype=torch.bool)
    for i, tokens in enumerate(rollout.tokens):
        batch["input_ids"][i, :len(tokens)] = torch.tensor(tokens)
        batch["attention_mask"][i, :len(tokens)] = True
        calls = [c for c in rollout.calls[i] if c is not None]      # aborted calls returned no routes
        if not calls:
            continue
        rows = torch.from_numpy(first_seen_rows(calls)[0].astype("int32"))
        batch[ROUTES_KEY][i, :len(rows)] = rows
        valid[i, :len(rows)] = True
    if VALID_KEY is not None:
        batch[VALID_KEY] = valid
    return batch


class ToyEngine:
    """The toy framework's engine: its phase methods and the method that runs Megatron's schedule
    once per pass."""

    def __init__(self, chunks: list, ctx) -> None:
        self.chunks, self.ctx = chunks, ctx

    def split(self, batch: dict, groups) -> list[dict]:
        """The toy framework's micro-batching: the samples ``groups[m]`` of ``batch``, every field."""
        return [{k: v[torch.tensor(list(g))] for k, v in batch.items()} for g in groups]

    def compute_log_prob(self, batch: dict, groups) -> list:
        return self.forward_backward(self.split(batch, groups), forward_only=True)

    def update(self, batch: dict, groups) -> list:
        # the toy's update computes its loss only (a real one runs backward and steps the optimizer)
        return self.forward_backward(self.split(batch, groups), forward_only=True)

    def forward_backward(self, micro_batches: list[dict], forward_only: bool = False):
        from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

        vocab = self.chunks[0].vocab_size
        align = align_for(self.ctx.tp, self.ctx.cp)
        self.packed = [pack_thd([ids[mask].tolist() for ids, mask in zip(mb["input_ids"], mb["attention_mask"].bool())],
                                vocab_size=vocab, align=align) for mb in micro_batches]
        return run_schedule(self.chunks, self.packed, make_forward_step(self.ctx, thd=True, collect_logits=True),
                            forward_only=forward_only)


class R3ToyEngine(TemplateEngineMixin, ToyEngine):
    """The adapter's mixin in front of the framework's engine, as in a real job."""


# ---------------------------------------------------------------------------------- the runner of checks 4-5
class TemplateRunner:
    """:class:`r3bridge.testing.kit.runner.MegatronRunner` of the adapter on the toy engine: each
    pass runs through the framework's phase method (``engine_class``'s ``compute_log_prob`` /
    ``update``, the adapter's overrides in front), never the schedule call directly."""

    engine_class: type = R3ToyEngine

    def __init__(self, rollout: CanonicalRollout) -> None:
        self.codec = TemplateCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                                   num_hidden_layers=rollout.num_layers, topk=rollout.topk)
        self.batch = framework_batch(rollout)

    def attach(self, ctx, chunks, mode):
        engine = self.engine_class(chunks, ctx)
        engine.r3_config = ReplayConfig(replay_mode=mode)
        engine.r3_attach(chunks, self.codec)
        engine.replayer = engine.r3.replayer
        return engine

    def micro_batches(self, rollout, groups, *, key):
        # the framework cuts its batch in its phase methods: hand them the samples of each micro-batch
        return [list(g) for g in groups]

    def run(self, engine, groups, *, phase):
        phase_method = engine.compute_log_prob if Phase(phase) is Phase.OLD_LOG_PROB else engine.update
        for chunk in engine.chunks:
            chunk.eval()
        with record_packing(engine.chunks[0]) as packing:
            outputs = phase_method(self.batch, groups)
        per_sample = [rows for out, packed in zip(outputs, engine.packed)     # last pipeline stage only
                      for rows in unpack_rows(out.logits, packed)]
        return {"logprobs": per_sample, "metrics": dict(engine.r3.result.metrics),
                "recorded": engine.r3.result.recorded, "packing": packing}

    def write_recorded(self, rollout, recorded):
        """Nothing to write: the adapter's ``compute_log_prob`` wrote the recording back into the
        batch, as in a real job."""


# ---------------------------------------------------------------------------------- checks 1-5
class TemplateFixtures(AdapterFixtures):
    @pytest.fixture
    def codec(self, rollout):
        return TemplateCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
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
        return TemplateRunner

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls):
        return CPU_LAYOUTS          # 1 rank, TP2 + SP, CP2, PP2 x VPP2 (GPU_LAYOUTS on a GPU machine)

    @pytest.fixture(scope="class")
    @classmethod
    def reader_form(cls):
        return "padded/mask"        # your codec's handed_routes: what the one reader reads per micro-batch


class TestTemplateIngest(BaseIngestTests, TemplateFixtures):
    """Checks 1-3, and the rollout side: the engine calls of each sample, stitched first-seen."""

    def test_rollout_ingest(self, rollout):
        ingest = TemplateRollout(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                                 topk=rollout.topk)
        read = canonical_form(ingest.routes_from_rollout(rollout.calls), [len(t) for t in rollout.tokens])
        assert_same_batch(read, rollout.expected(), "TemplateRollout")


class TestTemplateMegatron(BaseMegatronTests, TemplateFixtures):
    """Checks 4-5."""
