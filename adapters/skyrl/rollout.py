"""SkyRL's generator side: each engine call's routes -> :class:`r3bridge.ReplayBatch`, stitched.

What SkyRL 0.3.x hands around per engine call, ``InferenceEngineOutput["rollout_expert_indices"]
[i]``, ``[prompt + generated - 1, num_hidden_layers, K]``, in any of vLLM's transports
(:func:`r3bridge.engines.decoders.decode_vllm_routes`): in-process ``CompletionOutput.routed_experts``,
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

from r3bridge.adapters.skyrl.codec import ENGINE
from r3bridge.batch.provenance import RouteProvenance
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import decode_vllm_routes
from r3bridge.ingest.stitching import first_seen_rows, rollout_routes

__all__ = ["SkyRLRollout", "decode_routed_experts", "rollout_routes", "merge_first_seen", "call_provenance"]

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
    """SkyRL's per-sample list ``[rows, L_all, K]`` accumulated over turns, first-seen
    (:func:`r3bridge.ingest.stitching.first_seen_rows`; both start at row 0: SkyRL sends the whole
    conversation as each turn's prompt)."""
    if new is None:
        return previous
    if previous is None or len(previous) == 0:
        return list(new)
    return first_seen_rows([previous, new])[0].tolist()


def call_provenance(version_at_submit: Optional[int], version_at_return: Optional[int], *,
                    epoch: Optional[int] = None) -> tuple[RouteProvenance, RouteProvenance]:
    """(route provenance, log-prob provenance) of one sample's first engine call from SkyRL's
    inference client ``weight_version`` (one step per weight sync) read when the call was submitted
    and when it returned. A weight sync in between means the engine may have re-prefilled the
    request under the new weights (SGLang's retraction during an async weight update, miles #3277):
    its routes then come from the newer version, the log-probs of its first tokens from the older.
    ``epoch``: the engine's re-prefill count where it reports one (SGLang ``num_retractions``)."""
    routes = RouteProvenance(ENGINE, "", version_at_return, epoch)
    logprobs = RouteProvenance(ENGINE, "", version_at_submit, None if epoch is None else 0)
    return routes, logprobs
