"""Routes by reference through the real driver: the template adapter's engine on the CPU Megatron
harness, its rollout side writing each sample's stitched routes once (``handles_from_rollout``),
its engine handing the driver ``r3bridge.handles.handed_routes`` of each micro-batch's handles;
R2's recorded routes stored the same way (only handles go back). The conformance kit's checks 4-5
decide: every router replays exactly the canonical routes (R3), and R2's replay reproduces its
recording, on TP2 + SP, CP2 and PP2 x VPP2 (one set of 2 rank processes)."""
from __future__ import annotations

import functools

import pytest
import torch

from r3bridge.adapters._template import SAMPLE_KEY, TemplateRollout
from r3bridge.adapters._template.conformance_tests import R3ToyEngine, TemplateFixtures, TemplateRunner
from r3bridge.config import Action, ReplayConfig
from r3bridge.handles import FileRoutes, RouteStore, handed_routes
from r3bridge.megatron import MicroBatch
from r3bridge.testing.kit import conformance as kit
from r3bridge.testing.kit.suite import BaseMegatronTests


class HandlesToyEngine(R3ToyEngine):
    """The template engine, its routes by reference: each micro-batch's routes are its samples'
    handles, handed to the driver unread."""

    runner: "HandlesTemplateRunner"
    r3_route_transports = ("inline", "handles")

    def update(self, batch, groups):
        # each micro-batch names its samples, so its handles can be looked up (the template's own
        # engine carries the sample index through compute_log_prob only: R2 records by it)
        batch[SAMPLE_KEY] = torch.arange(len(batch["input_ids"]))
        try:
            return super().update(batch, groups)
        finally:
            batch.pop(SAMPLE_KEY, None)

    def _r3_micro_batch(self, k, mb, plan):
        if plan.action is not Action.REPLAY:
            return super()._r3_micro_batch(k, mb, plan)
        runner = self.runner
        handles = runner.handles if plan.route_kind == "rollout" else runner.recorded
        step = 0 if plan.route_kind == "rollout" else 1
        seq_lens = self.r3_codec.seq_lens(mb)
        routes = handed_routes([handles[i] for i in mb[SAMPLE_KEY].tolist()], runner.resolvers, seq_lens,
                               run_id=runner.store.run_id, step=step, framework="template")
        return MicroBatch(seq_lens, routes)


class HandlesTemplateRunner(TemplateRunner):
    """The template's runner, routes by reference (each rank process writes its own run: the
    rollout side of a real job writes once)."""

    def __init__(self, rollout, store_dir: str) -> None:
        super().__init__(rollout)
        self.store = RouteStore(FileRoutes(store_dir), block_rows=4)
        self.resolvers = {self.store.name: self.store.backend}
        self.names = [f"sample-{i}" for i in range(rollout.batch_size)]
        ingest = TemplateRollout(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                                 topk=rollout.topk)
        self.handles = ingest.handles_from_rollout(rollout.calls, self.store, self.names, step=0)
        self.recorded = None

    def attach(self, ctx, chunks, mode):
        engine = HandlesToyEngine(chunks, ctx)
        engine.runner = self
        engine.r3_config = ReplayConfig(replay_mode=mode, route_transport="handles")
        engine.r3_attach(chunks, self.codec)
        engine.replayer = engine.r3.replayer
        return engine

    def write_recorded(self, rollout, recorded):
        """R2: the recorded routes go to the store, the batch gets nothing (only handles go back)."""
        self.recorded = self.store.put_batch(recorded, self.names, step=1)


class TestHandlesThroughTheDriver(BaseMegatronTests, TemplateFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def megatron_runner(cls, tmp_path_factory):
        return functools.partial(HandlesTemplateRunner, store_dir=str(tmp_path_factory.mktemp("routes")))

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls):
        return [x for x in kit.CPU_LAYOUTS if x[0] == 2]         # TP2 + SP, CP2, PP2 x VPP2

    @pytest.fixture(scope="class")
    @classmethod
    def reader_form(cls):
        return "handles/none"
