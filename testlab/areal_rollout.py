"""A canonical rollout generated through AReaL 1.0.4's own SGLang client code (tests only).

* :class:`FakeSGLang` - the SGLang server for one sample of a
  :class:`~r3bridge.testing.kit.conformance.CanonicalRollout`: the exact ``/generate`` JSON
  (``meta_info`` with base64 int32 ``routed_experts`` from row 0 of the request,
  ``prompt_tokens``, ``completion_tokens``, ``finish_reason``; ``abort`` where the rollout
  resubmits the request).
* :class:`ResubmitLoop` - ``RemoteInfEngine.agenerate``'s loop of AReaL 1.0.4 with AReaL's real
  ``SGLangBackend`` (``areal/engine/sglang_remote.py``: ``build_generation_request`` on AReaL's
  ``ModelRequest``, ``parse_generation_response``'s base64 decode) posting to ``FakeSGLang``
  instead of over HTTP; like AReaL it ``np.concatenate``s every attempt's routes.
* :func:`trajectories` - one trajectory dict per sample from a parent-concat episode (one
  request per turn, as AReaL's RLVR / multi-turn workflows) wrapped in r3bridge's
  ``WorkflowMixin`` (resubmit dedupe, first-seen multi-turn stitching, the routes tensor).
"""
from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from r3bridge.testing.kit.conformance import CanonicalRollout
from testlab.areal_env import import_areal

__all__ = ["FakeSGLang", "ResubmitLoop", "trajectories"]


class FakeSGLang:
    """Answers ``/generate`` payloads for sample ``i`` of ``rollout``."""

    def __init__(self, rollout: CanonicalRollout, i: int) -> None:
        self.r, self.i = rollout, i

    def generate(self, payload: dict) -> dict:
        prompt = list(payload["input_ids"])
        r, i = self.r, self.i
        t = next(t for t, (pl, toks) in enumerate(zip(r.call_prompt_lens[i], r.call_tokens[i]))
                 if pl == len(prompt) and toks[:pl] == prompt)
        toks, routes = r.call_tokens[i][t], r.calls[i][t]
        out = toks[len(prompt):]
        resubmitted_next = t + 1 < len(r.call_tokens[i]) and r.call_prompt_lens[i][t + 1] == len(toks)
        return {"text": "", "meta_info": {
            "finish_reason": {"type": "abort" if resubmitted_next else "stop"},
            "prompt_tokens": len(prompt), "completion_tokens": len(out),
            "output_token_logprobs": [[-0.5, tok, None] for tok in out],
            "routed_experts": base64.b64encode(routes.astype("<i4").tobytes()).decode("ascii"),
        }}


class ResubmitLoop:
    """``RemoteInfEngine.agenerate``'s resubmit loop around AReaL's real ``SGLangBackend``."""

    def __init__(self, server: FakeSGLang) -> None:
        self.server = server
        self.backend = import_areal("areal.engine.sglang_remote").SGLangBackend()

    async def agenerate(self, req: Any) -> Any:
        io = import_areal("areal.api.io_struct")
        cli = import_areal("areal.api.cli_args")
        req = io.ModelRequest(input_ids=list(req.input_ids), gconfig=cli.GenerationHyperparameters(max_new_tokens=64),
                              metadata={"return_routed_experts": True})
        out_tokens: list[int] = []
        out_logprobs: list[float] = []
        routes: list[np.ndarray] = []
        stop_reason = None
        while stop_reason not in ("stop", "tool_calls", "length"):
            http = self.backend.build_generation_request(req, with_lora=False, version=0)
            res = self.backend.parse_generation_response(self.server.generate(http.payload))
            stop_reason = res.stop_reason
            out_tokens += res.output_tokens
            out_logprobs += res.output_logprobs
            if res.routed_experts is not None:
                routes.append(res.routed_experts)
            req.input_ids += res.output_tokens
        return io.ModelResponse(input_tokens=req.input_ids[: len(req.input_ids) - len(out_tokens)],
                                output_tokens=out_tokens, output_logprobs=out_logprobs, stop_reason=stop_reason,
                                routed_experts=np.concatenate(routes) if routes else None)


class _Engine:
    """The shape of ``RemoteSGLangEngine``: the loop is its ``_engine`` (r3bridge's
    ``RecordingBackend`` goes on the loop's ``backend``, as on ``RemoteInfEngine``)."""

    def __init__(self, loop: ResubmitLoop) -> None:
        self._engine = loop

    async def agenerate(self, req: Any) -> Any:
        return await self._engine.agenerate(req)


class _Episode:
    """Parent-concat: one request per turn (each prompt = the previous context + new tokens);
    the trajectory is the rollout's final tokens."""

    def __init__(self, rollout: CanonicalRollout) -> None:
        self.r = rollout

    async def arun_episode(self, engine: Any, data: dict) -> dict:
        i, r = data["i"], self.r
        for t, pl in enumerate(r.call_prompt_lens[i]):
            if t and pl == len(r.call_tokens[i][t - 1]):
                continue                     # a resubmit happens inside agenerate
            await engine.agenerate(SimpleNamespace(input_ids=r.call_tokens[i][t][:pl]))
        seq = r.tokens[i]
        p = r.prompt_lens[i]
        return {"input_ids": torch.tensor([seq], dtype=torch.int32),
                "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
                "loss_mask": torch.tensor([[0] * p + [1] * (len(seq) - p)], dtype=torch.int32),
                "logprobs": torch.full((1, len(seq)), -0.5, dtype=torch.float32),
                "rewards": torch.tensor([float(i % 2)])}


def trajectories(rollout: CanonicalRollout) -> list[dict]:
    """One AReaL trajectory dict per sample, ``r3bridge_routes`` added by ``WorkflowMixin``."""
    from r3bridge.adapters.areal import WorkflowMixin
    from r3bridge.hf import ModelInfo

    class Episode(WorkflowMixin, _Episode):
        r3_model = ModelInfo(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                             num_layers=rollout.num_layers, topk=rollout.topk)

    return [asyncio.run(Episode(rollout).arun_episode(_Engine(ResubmitLoop(FakeSGLang(rollout, i))), {"i": i}))
            for i in range(rollout.batch_size)]
