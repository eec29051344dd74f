"""verl 0.9's tool agent loop with first-seen routes: each token keeps the route that sampled it.

verl 0.9.1's ``ToolAgentLoop`` keeps only the last server call's ``routed_experts``
(``experimental/agent_loop/tool_agent_loop.py:286``). A later turn re-sends the whole context, so
that array's rows for earlier turns' tokens are the re-prefill's routes, not the ones those
tokens were sampled with; R3 then replays routes the rollout never sampled with.
:class:`FirstSeenToolAgentLoop` is verl's own loop with one change: after every server call the
sample's routes are the calls stitched first-seen (:meth:`VerlRollout.agent_loop_routes`, the
core's append-only rule), and the rows a later call re-prefilled differently are counted.

Enable it through verl's agent loop registry (no patch of any verl class): an agent loop config
file (``actor_rollout_ref.rollout.agent.agent_loop_config_path``) with

.. code-block:: yaml

    - name: r3bridge_tool_agent
      _target_: r3bridge.adapters.verl.agent_loop.FirstSeenToolAgentLoop

and ``agent_name: r3bridge_tool_agent`` in the dataset (or
``actor_rollout_ref.rollout.agent.default_agent_loop=r3bridge_tool_agent``).

Per sample, ``extra_fields`` gains :data:`OVERLAP_KEY` (rows a later call re-sent) and
:data:`DISAGREE_KEY` (those whose re-prefill route differs from the first-seen one), which verl
carries in the batch's non-tensor fields; :func:`stitch_metrics` turns a batch's values into
metrics. It also gains the sample's route and log-prob provenance
(:data:`r3bridge.adapters.verl.codec.ROUTE_PROVENANCE_KEY` / ``LOGPROB_PROVENANCE_KEY``,
:func:`r3bridge.adapters.verl.rollout.call_provenance`), which the engine compares per
``provenance_check``; a turn generated again (a retry: the call does not continue the context)
starts the next attempt, so a sample whose first-seen rows come from an attempt its tokens do
not is counted or refused, never replayed in silence.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop

from r3bridge.adapters.verl.codec import LOGPROB_PROVENANCE_KEY, ROUTE_PROVENANCE_KEY
from r3bridge.adapters.verl.rollout import VerlRollout, call_provenance

logger = logging.getLogger("r3bridge.adapters.verl")

__all__ = ["FirstSeenToolAgentLoop", "OVERLAP_KEY", "DISAGREE_KEY", "stitch_metrics"]

OVERLAP_KEY = "r3bridge_reprefill_rows"
DISAGREE_KEY = "r3bridge_reprefill_disagreeing_rows"


class _RouteCapture:
    """The agent loop's server client, forwarding every call and keeping each call's routes, and
    numbering attempts: a call whose prompt does not continue what the calls before it produced
    (prompt + output) throws that output away and generates again, a retry, so it starts the next
    attempt. (verl 0.9.1's own loops never retry a turn, and its resuming client continues an
    aborted request inside one call; a custom loop that regenerates a turn is what this sees.)"""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[Any] = []
        self.outputs: list[Any] = []     # the TokenOutputs of those calls (their provenance)
        self.attempts: list[int] = []    # the attempt of each of those calls
        self._attempt = 0
        self._context: list[int] | None = None

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._inner.generate(*args, **kwargs)
        prompt = [int(x) for x in kwargs.get("prompt_ids") or []]
        if self._context is not None and prompt[:len(self._context)] != self._context:
            self._attempt += 1
        self._context = prompt + [int(x) for x in (getattr(out, "token_ids", None) or [])]
        if out.routed_experts is not None:
            self.calls.append(out.routed_experts)
            self.outputs.append(out)
            self.attempts.append(self._attempt)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FirstSeenToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` whose ``routed_experts`` are first-seen across the sample's calls."""

    first_seen: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_manager = _RouteCapture(self.server_manager)
        self._r3_rollout: VerlRollout | None = None

    def _rollout(self) -> VerlRollout:
        if self._r3_rollout is None:
            from transformers import AutoConfig

            model = self.config.actor_rollout_ref.model
            hf = AutoConfig.from_pretrained(model.get("local_path") or model.path,
                                            trust_remote_code=bool(model.get("trust_remote_code", False)))
            self._r3_rollout = VerlRollout.from_hf_config(hf)
        return self._r3_rollout

    async def _handle_generating_state(self, agent_data: Any, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> AgentState:
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        calls = self.server_manager.calls
        if calls and self.first_seen:
            routes, report = self._rollout().agent_loop_routes(calls, sample=str(agent_data.request_id))
            agent_data.routed_experts = routes
            agent_data.extra_fields[OVERLAP_KEY] = int(sum(report.overlap_rows))
            agent_data.extra_fields[DISAGREE_KEY] = int(report.total_disagreeing)
            routes_from, logprobs_from = call_provenance(self.server_manager.outputs,
                                                         engine=str(self.config.actor_rollout_ref.rollout.name or "verl"),
                                                         request_id=str(agent_data.request_id),
                                                         attempts=self.server_manager.attempts)
            agent_data.extra_fields[ROUTE_PROVENANCE_KEY] = routes_from
            agent_data.extra_fields[LOGPROB_PROVENANCE_KEY] = logprobs_from
        return state


def stitch_metrics(values: Sequence[Any], overlap: Sequence[Any], prefix: str = "r3bridge/rollout/") -> dict[str, float]:
    """A batch's per-sample :data:`DISAGREE_KEY` / :data:`OVERLAP_KEY` values (None for samples of
    other agent loops) -> ``{prefix}reprefill_rows``, ``{prefix}reprefill_disagreeing_rows`` and
    their ratio."""
    dis = np.array([float(v) for v in values if v is not None])
    ov = np.array([float(v) for v in overlap if v is not None])
    total_dis, total_ov = float(dis.sum()) if dis.size else 0.0, float(ov.sum()) if ov.size else 0.0
    return {f"{prefix}reprefill_rows": total_ov, f"{prefix}reprefill_disagreeing_rows": total_dis,
            f"{prefix}reprefill_disagreement": total_dis / total_ov if total_ov else 0.0}
