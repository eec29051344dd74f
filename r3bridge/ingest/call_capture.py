"""A rollout client's engine calls captured per sample, one sample's calls as its first-seen rows,
and where a sample stitched from them got its routes and its log-probs (:mod:`r3bridge.ingest.capture`,
"Route provenance" in docs/architecture.md).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.batch.provenance import RouteProvenance
from r3bridge.errors import ProvenanceError
from r3bridge.hf import ModelInfo
from r3bridge.ingest.capture import CallLog, StitchedRollout, checked_calls
from r3bridge.ingest.stitching import StitchReport, first_seen_rows

__all__ = ["CapturingClient", "FirstSeenCalls", "first_seen_provenance"]


class CapturingClient(CallLog):
    """An async engine client (``await client.generate(..., prompt_ids=...)``) forwarding every call
    and logging it: the prompt, the output's token ids and routes (attribute names as the
    framework's output type spells them) and the output itself."""

    def __init__(self, inner: Any, *, prompt_kwarg: str = "prompt_ids", tokens_attr: str = "token_ids",
                 routes_attr: str = "routed_experts") -> None:
        super().__init__()
        self._inner = inner
        self._names = (prompt_kwarg, tokens_attr, routes_attr)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._inner.generate(*args, **kwargs)
        prompt, tokens, routes = self._names
        self.record(kwargs.get(prompt), getattr(out, tokens, None), getattr(out, routes), out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FirstSeenCalls(StitchedRollout):
    """A :class:`~r3bridge.ingest.capture.StitchedRollout` of engine calls that report every hidden
    layer from row 0 (vLLM / SGLang), and one sample's calls as its first-seen rows in that layout."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int,
                 topk: Optional[int] = None) -> None:
        super().__init__(num_experts=num_experts, moe_layer_ids=moe_layer_ids, topk=topk)
        self.num_hidden_layers = int(num_hidden_layers)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Any:
        info = ModelInfo.from_hf_config(hf_config)
        return cls(num_experts=info.num_experts, moe_layer_ids=info.moe_layer_ids, num_hidden_layers=info.num_layers,
                   topk=info.topk)

    def sample_rows(self, calls: Sequence[Any], *, sample: str = "") -> tuple[np.ndarray, StitchReport]:
        """One sample's calls' routes (``[rows, num_hidden_layers, K]`` each, from row 0), checked
        -> its first-seen rows in the same layout and the stitch report."""
        checked_calls(calls, num_hidden_layers=self.num_hidden_layers, topk=self.topk, sample=sample)
        return first_seen_rows(calls)


def first_seen_provenance(engine: str, request_id: Any, *, calls: int, version: Optional[int],
                          epoch: Optional[int], sampled_version: Optional[int] = None,
                          attempts: Optional[Sequence[int]] = None) -> tuple[RouteProvenance, RouteProvenance]:
    """(where a sample's routes came from, where its log-probs came from) for ``calls`` engine calls
    stitched first-seen: the earliest tokens keep the first call's rows, so the routes are its pass
    (weight ``version``, ``epoch``: its re-prefills); the first tokens' log-probs were sampled in
    its first pass (epoch 0, weight ``sampled_version`` where the engine reports it, else
    ``version``). ``attempts`` (one per call, :class:`~r3bridge.ingest.capture.CallLog`'s): the
    routes are the first call's attempt, the log-probs (and tokens) the last call's; ``None``: unknown."""
    if not calls:
        raise ProvenanceError(f"sample {request_id or '?'}: no server call to take provenance from")
    if attempts is not None and len(attempts) != calls:
        raise ProvenanceError(f"sample {request_id or '?'}: {len(attempts)} attempts for {calls} server calls")
    first, last = (None, None) if attempts is None else (attempts[0], attempts[-1])
    routes = RouteProvenance(engine, str(request_id), version, epoch, first)
    sampled = version if sampled_version is None else sampled_version
    logprobs = RouteProvenance(engine, str(request_id), sampled, 0, last)
    return routes, logprobs
