"""A rollout client's engine calls captured per sample, one sample's calls as its first-seen rows,
and where a sample stitched from them got its routes and its log-probs (:mod:`r3bridge.ingest.capture`,
"Route provenance" in docs/architecture.md), read from its engine outputs by the names the
framework's output type spells (:func:`outputs_provenance`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int
from r3bridge.errors import ProvenanceError
from r3bridge.hf import ModelInfo
from r3bridge.ingest.capture import CallLog, StitchedRollout, checked_calls
from r3bridge.ingest.forwarding import Forwarding
from r3bridge.ingest.stitching import StitchReport, first_seen_rows

__all__ = ["CapturingClient", "FirstSeenCalls", "first_seen_provenance", "outputs_provenance", "output_reading"]


class CapturingClient(Forwarding, CallLog):
    """An async engine client (``await client.generate(..., prompt_ids=...)``) forwarding every call
    and logging it: the prompt, the output's token ids and routes (attribute names as the
    framework's output type spells them) and the output itself."""

    def __init__(self, inner: Any, *, prompt_kwarg: str = "prompt_ids", tokens_attr: str = "token_ids",
                 routes_attr: str = "routed_experts") -> None:
        Forwarding.__init__(self, inner)
        CallLog.__init__(self)
        self._names = (prompt_kwarg, tokens_attr, routes_attr)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await self.inner.generate(*args, **kwargs)
        prompt, tokens, routes = self._names
        self.record(kwargs.get(prompt), getattr(out, tokens, None), getattr(out, routes), out)
        return out


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

    @classmethod
    def from_pretrained(cls, path: str, *, trust_remote_code: bool = False) -> Any:
        """:meth:`from_hf_config` of the HF config at ``path`` (a model folder or hub name)."""
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))

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


def output_reading(output: Any, path: str) -> Optional[int]:
    """An engine output's ``path`` (an attribute, or ``attr.key`` into a mapping attribute) as a
    reported int (:func:`~r3bridge.batch.provenance.reported_int`); missing anywhere: ``None``."""
    value = output
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
        if value is None:
            return None
    return reported_int(value)


def outputs_provenance(outputs: Sequence[Any], *, engine: str, request_id: Any, version: str, epoch: str,
                       sampled_version: str, attempts: Optional[Sequence[int]] = None,
                       ) -> tuple[RouteProvenance, RouteProvenance]:
    """:func:`first_seen_provenance` of one sample's engine outputs (in call order), the weight
    ``version``, ``epoch`` and ``sampled_version`` read from the first output at those paths
    (:func:`output_reading`)."""
    first = outputs[0] if outputs else None
    return first_seen_provenance(engine, request_id, calls=len(outputs), version=output_reading(first, version),
                                 epoch=output_reading(first, epoch),
                                 sampled_version=output_reading(first, sampled_version), attempts=attempts)
