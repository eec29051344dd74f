"""verl's agent loop's server calls: captured per sample (the one call recorder around verl's
server client), one sample's calls as its first-seen rows, and where a sample stitched from them
got its routes and its log-probs, read from verl's ``TokenOutput``s (the one provenance rule,
:func:`r3bridge.rollout.provenance.first_seen_provenance`; "Route provenance" in docs/architecture.md).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int, vllm_provenance
from r3bridge.errors import RouteShapeError
from r3bridge.hf import ModelInfo
from r3bridge.rollout.capture import StitchedRollout
from r3bridge.rollout.forwarding import CallRecorder, RecordedCall
from r3bridge.rollout.provenance import first_seen_provenance
from r3bridge.rollout.stitching import StitchReport, first_seen_rows

__all__ = ["CallLog", "CapturingClient", "FirstSeenCalls", "checked_calls", "outputs_provenance", "output_reading"]


class CallLog:
    """One sample's engine calls in call order: :attr:`calls` (each call's routes, those that
    returned some), :attr:`outputs` (the engine's output of each: where its provenance is read)
    and :attr:`attempts` (the attempt each belongs to): a call whose prompt does not continue what
    the calls before it produced regenerates, so it starts the next attempt (NeMo RL #4057; verl's
    tool agent loop retries a turn so)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.outputs: list[Any] = []
        self.attempts: list[int] = []
        self._attempt = 0
        self._context: Optional[list[int]] = None

    def record(self, prompt_ids: Optional[Sequence[int]], output_ids: Optional[Sequence[int]], routes: Any,
               output: Any = None) -> None:
        """One call: its prompt and generated token ids (numbering the attempt), its routes
        (``None``: the call returned none, it is not kept) and the engine's output."""
        prompt = [int(x) for x in prompt_ids or []]
        if self._context is not None and prompt[:len(self._context)] != self._context:
            self._attempt += 1                     # the output before is thrown away: a retry
        self._context = prompt + [int(x) for x in output_ids or []]
        if routes is not None:
            self.calls.append(routes)
            self.outputs.append(output)
            self.attempts.append(self._attempt)


class CapturingClient(CallRecorder, CallLog):
    """verl's async server client (``await client.generate(..., prompt_ids=...)``) forwarding every
    call and logging it (:class:`CallLog`): the prompt, the output's token ids and routes
    (attribute names as verl's ``TokenOutput`` spells them) and the output itself."""

    def __init__(self, inner: Any, *, prompt_kwarg: str = "prompt_ids", tokens_attr: str = "token_ids",
                 routes_attr: str = "routed_experts") -> None:
        CallRecorder.__init__(self, inner, "generate", record=self._log_call)
        CallLog.__init__(self)
        self._names = (prompt_kwarg, tokens_attr, routes_attr)

    def _log_call(self, call: RecordedCall) -> None:
        prompt, tokens, routes = self._names
        out = call.result
        self.record(call.kwargs.get(prompt), getattr(out, tokens, None), getattr(out, routes), out)


def checked_calls(calls: Sequence[Any], *, num_hidden_layers: int, topk: Optional[int] = None,
                  sample: str = "", what: str = "routed_experts") -> None:
    """Each call's routes ``[rows, num_hidden_layers, K]`` (every decoder layer, as vLLM / SGLang
    report them) of the model's top-k, else ``RouteShapeError`` naming the sample and the call."""
    where = f"sample {sample}: " if sample else ""
    for t, call in enumerate(calls):
        shape = np.shape(call)
        if len(shape) != 3 or shape[1] != num_hidden_layers:
            raise RouteShapeError(f"{where}server call {t} returned {what} of shape {list(shape)}; "
                                  f"expected [rows, num_hidden_layers={num_hidden_layers}, topk]")
        if topk is not None and shape[2] != topk:
            raise RouteShapeError(f"{where}server call {t} returned {what} with top-k {shape[2]}, "
                                  f"the model routes top-{topk} (num_experts_per_tok)")


class FirstSeenCalls(StitchedRollout):
    """A :class:`~r3bridge.rollout.capture.StitchedRollout` of server calls that report every hidden
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


def output_reading(output: Any, path: str) -> Optional[int]:
    """An engine output's ``path`` (an attribute, or ``attr.key`` into a mapping attribute) as a
    reported int (:func:`~r3bridge.batch.provenance.reported_int`); missing anywhere: ``None``."""
    value = output
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
        if value is None:
            return None
    return reported_int(value)


def outputs_provenance(outputs: Sequence[Any], *, engine: str, request_id: Any, version: str, sampled_version: str,
                       attempts: Optional[Sequence[int]] = None) -> tuple[RouteProvenance, RouteProvenance]:
    """The first-seen provenance of one sample's server outputs (in call order): the first output's
    pass read as vLLM reports it (:func:`~r3bridge.batch.provenance.vllm_provenance`: epoch
    ``num_preempted``), its weight ``version`` and the first tokens' ``sampled_version`` (else
    ``version``) read at those paths (:func:`output_reading`)."""
    first = outputs[0] if outputs else None
    weight_version = output_reading(first, version)
    sampled = output_reading(first, sampled_version)
    first_pass = vllm_provenance(first, weight_version=weight_version, engine=engine, request_id=str(request_id))
    return first_seen_provenance(first_pass, calls=len(outputs), attempts=attempts,
                                 sampled_version=weight_version if sampled is None else sampled)
