"""verl 0.9's tool agent loop with first-seen routes: each token keeps the route that sampled it.

After every server call a sample's ``routed_experts`` are its calls stitched first-seen, and
``extra_fields`` gains the re-prefill counts and the route / log-prob provenance (``_target_:
r3bridge.adapters.verl.agent_loop.FirstSeenToolAgentLoop``): docs/use-with-verl.md, "Multi-turn".
"""
from __future__ import annotations

import functools
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop

from r3bridge.adapters.verl.calls import CapturingClient
from r3bridge.adapters.verl.rollout import VerlRollout, call_provenance
from r3bridge.batch.provenance import LOGPROB_PROVENANCE_KEY, ROUTE_PROVENANCE_KEY

__all__ = ["FirstSeenToolAgentLoop", "OVERLAP_KEY", "DISAGREE_KEY"]

OVERLAP_KEY = "r3bridge_reprefill_rows"
DISAGREE_KEY = "r3bridge_reprefill_disagreeing_rows"


class FirstSeenToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` whose ``routed_experts`` are first-seen across the sample's calls."""

    first_seen: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_manager = CapturingClient(self.server_manager)

    @functools.cached_property
    def _r3_rollout(self) -> VerlRollout:
        model = self.config.actor_rollout_ref.model
        return VerlRollout.from_pretrained(model.get("local_path") or model.path,
                                           trust_remote_code=bool(model.get("trust_remote_code", False)))

    async def _handle_generating_state(self, agent_data: Any, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> AgentState:
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        log = self.server_manager
        if log.calls and self.first_seen:
            sample = str(agent_data.request_id)
            routes, report = self._r3_rollout.sample_rows(log.calls, sample=sample)
            agent_data.routed_experts = routes
            engine = str(self.config.actor_rollout_ref.rollout.name or "verl")
            routes_from, logprobs_from = call_provenance(log.outputs, engine=engine, request_id=sample,
                                                         attempts=log.attempts)
            # per-sample RouteProvenance objects: verl carries extra_fields as non-tensor batch fields
            agent_data.extra_fields.update({
                OVERLAP_KEY: int(sum(report.overlap_rows)), DISAGREE_KEY: int(report.total_disagreeing),
                ROUTE_PROVENANCE_KEY: routes_from, LOGPROB_PROVENANCE_KEY: logprobs_from})
        return state
