"""verl 0.9's tool agent loop with first-seen routes: each token keeps the route that sampled it.

After every server call a sample's ``routed_experts`` are its calls stitched first-seen, and
``extra_fields`` gains the re-prefill counts and the route / log-prob provenance (``_target_:
r3bridge.adapters.verl.agent_loop.FirstSeenToolAgentLoop``): docs/use-with-verl.md, "Multi-turn".

Routes by reference (``r3bridge.route_transport: handles``): both loops here
(:class:`FirstSeenToolAgentLoop`, and :class:`HandleSingleTurnAgentLoop` for verl's single-turn
prompts) store each sample's finished routes once and carry the handle in ``extra_fields`` instead
of the bytes (:mod:`r3bridge.adapters.verl.route_handles`); with inline routes they are verl's own.
"""
from __future__ import annotations

import functools
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop

from r3bridge.adapters.verl.calls import CapturingClient
from r3bridge.adapters.verl.rollout import VerlRollout, call_provenance
from r3bridge.adapters.verl.route_handles import HANDLE_KEY, RouteWriter, sample_name, uses_handles
from r3bridge.batch.provenance import LOGPROB_PROVENANCE_KEY, ROUTE_PROVENANCE_KEY
from r3bridge.config import ReplayConfig

__all__ = ["FirstSeenToolAgentLoop", "HandleSingleTurnAgentLoop", "StoredRoutes", "OVERLAP_KEY", "DISAGREE_KEY"]

OVERLAP_KEY = "r3bridge_reprefill_rows"
DISAGREE_KEY = "r3bridge_reprefill_disagreeing_rows"


class StoredRoutes:
    """An agent loop whose finished sample's routes go to the route store when the job says
    ``route_transport: handles`` (the options forwarded in ``R3BRIDGE_CONFIG``): ``routed_experts``
    emptied, the handle's JSON in ``extra_fields[HANDLE_KEY]``, stored for the RL step verl drew the
    prompt for (``global_steps``) under a name no retry repeats."""

    @functools.cached_property
    def _r3_config(self) -> ReplayConfig:
        return ReplayConfig.resolve_with_origin(None)[0]

    @functools.cached_property
    def _r3_rollout(self) -> VerlRollout:
        model = self.config.actor_rollout_ref.model
        return VerlRollout.from_pretrained(model.get("local_path") or model.path,
                                           trust_remote_code=bool(model.get("trust_remote_code", False)))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        output = await super().run(sampling_params, **kwargs)
        if output.routed_experts is not None and uses_handles(self._r3_config):
            rollout = self._r3_rollout
            writer = RouteWriter(self._r3_config, moe_layer_ids=rollout.moe_layer_ids,
                                 num_hidden_layers=rollout.num_hidden_layers, num_experts=rollout.num_experts)
            output.extra_fields[HANDLE_KEY] = writer.put(output.routed_experts, step=int(kwargs["global_steps"]),
                                                         sample=sample_name(kwargs))
            output.routed_experts = None        # only the handle travels through verl's TransferQueue
        return output


class HandleSingleTurnAgentLoop(StoredRoutes, SingleTurnAgentLoop):
    """verl's ``SingleTurnAgentLoop``, its routes stored by reference under ``route_transport:
    handles`` (``_target_: r3bridge.adapters.verl.agent_loop.HandleSingleTurnAgentLoop``)."""


class FirstSeenToolAgentLoop(StoredRoutes, ToolAgentLoop):
    """verl's ``ToolAgentLoop`` whose ``routed_experts`` are first-seen across the sample's calls."""

    first_seen: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_manager = CapturingClient(self.server_manager)

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
