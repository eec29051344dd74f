"""SkyRL's generator side: each engine call's routes -> :class:`r3bridge.ReplayBatch`, stitched.

What SkyRL 0.3.x hands around per engine call, ``InferenceEngineOutput["rollout_expert_indices"]
[i]``, ``[prompt + generated - 1, num_hidden_layers, K]``, in any of vLLM's transports
(:func:`r3bridge.ingest.decode_vllm_routes`): in-process ``CompletionOutput.routed_experts``,
SkyRL 0.3.0's ``/skyrl/v1/generate`` JSON lists, base64 ``.npy`` (vLLM's OpenAI serving, newer
SkyRL).

SkyRL 0.3.0 *overwrites* the sample's routes with each new turn's (``AgentLoopState.
rollout_expert_indices = turn_output.rollout_expert_indices``): the later prefill re-routes
earlier tokens, so the routes that *sampled* them are lost. :class:`SkyRLRollout` stitches the
calls first-seen instead (``r3bridge.stitch``); :func:`merge_first_seen` does the same on SkyRL's
list format inside the generator (``hooks.FirstSeenRoutesMixin``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from r3bridge.errors import RouteShapeError
from r3bridge.ingest import decode_vllm_routes, rollout_routes
from r3bridge.schema import ReplayBatch

__all__ = ["SkyRLRollout", "decode_routed_experts", "rollout_routes", "merge_first_seen"]

decode_routed_experts = decode_vllm_routes


class SkyRLRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of SkyRL's generator."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int]) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]],
                            start_rows: Optional[Sequence[Sequence[int]]] = None) -> ReplayBatch:
        """``engine_outputs[i][t]``: routes engine call ``t`` of sample ``i`` returned (any
        transport), from row 0 unless ``start_rows[i][t]`` says otherwise."""
        return rollout_routes(engine_outputs, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids,
                              start_rows=start_rows)


def merge_first_seen(previous: Optional[list], new: Optional[list]) -> Optional[list]:
    """SkyRL's per-sample list ``[rows, L_all, K]`` accumulated over turns, first-seen: rows the
    earlier turns returned are kept, the new call only contributes rows past them. (Both start at
    row 0: SkyRL sends the whole conversation as each turn's prompt.)"""
    if new is None:
        return previous
    if previous is None or len(previous) == 0:
        return list(new)
    if len(new) and (len(new[0]) != len(previous[0]) or len(new[0][0]) != len(previous[0][0])):
        raise RouteShapeError(f"turn routes are [*, {len(new[0])}, {len(new[0][0])}], earlier turns "
                              f"[*, {len(previous[0])}, {len(previous[0][0])}]")
    return list(previous) + list(new[len(previous):])
