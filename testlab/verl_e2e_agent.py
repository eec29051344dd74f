"""The multi-turn part of the CPU verl job: a tool-calling format the tiny random model "speaks".

A random tiny model never writes a well-formed ``<tool_call>{json}</tool_call>``; the test gives
it a format of its own through verl's registries (no verl class changed):

* :class:`AlwaysCallParser`, registered as tool parser ``r3e2e`` (``ToolParser.register``; set
  ``actor_rollout_ref.rollout.multi_turn.format=r3e2e``): every assistant turn is a call of the
  one configured tool (the model "called the tool"), so a sample makes exactly
  ``max_assistant_turns`` server calls;
* :class:`CappedFirstSeen` / :class:`CappedLastCall`: r3bridge's
  :class:`~r3bridge.adapters.verl.agent_loop.FirstSeenToolAgentLoop` with first-seen stitching
  on or off (off = verl's own last-call behaviour, the control the test must fail with), each
  turn capped at :data:`TURN_TOKENS` tokens so the first turn leaves room for the tool's reply
  and a second turn inside ``response_length``;
* :class:`RecordingSingleTurn`: verl's own ``SingleTurnAgentLoop`` (through r3bridge's
  :class:`~r3bridge.adapters.verl.agent_loop.HandleSingleTurnAgentLoop`, verl's own loop unless the
  job stores routes by reference), registered as ``r3e2e_single_agent`` (the single-turn prompts'
  ``agent_name``).

Every one of them records what the rollout server handed back (:class:`CallRecorder`, under
``R3E2E_AGENT_LOG_DIR``): the prompt ids sent, the token ids and ``routed_experts`` returned, one
file per call in the format of the HF test server's own log, so the checker reads either. With
verl's own vLLM server (``R3E2E_ROLLOUT=vllm``) this is the only log of the routes vLLM returned;
with the HF backend both logs exist and must agree (tests/adapters/test_verl_e2e.py).

The tool is verl's own ``BaseTool`` (its ``execute`` answers "Updated the tool state.").
"""
from __future__ import annotations

import inspect
import os
import time
from typing import Any

import numpy as np
import torch
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

from r3bridge.adapters.verl.agent_loop import FirstSeenToolAgentLoop, HandleSingleTurnAgentLoop

TURN_TOKENS = 8
TOOL_NAME = "lookup"
AGENT_LOG_ENV = "R3E2E_AGENT_LOG_DIR"
SINGLE_TURN = "r3e2e_single_agent"
TOOL_AGENT = "r3e2e_tool_agent"


class CallRecorder:
    """The agent loop's server client: forwards every call, then saves the prompt ids it sent and
    the token ids and ``routed_experts`` the server returned (``call_a<pid>_<ns>_<n>.pt``, the
    fields of :meth:`testlab.verl_hf_rollout.HFServer._log`; ``routed_experts`` int16, an empty
    ``[0, 0, 0]`` array when the server returned None)."""

    def __init__(self, inner: Any, log_dir: str) -> None:
        self._inner = inner
        self._log_dir = log_dir
        self._calls = 0
        self._signature = inspect.signature(inner.generate)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._inner.generate(*args, **kwargs)
        sent = dict(kwargs)      # verl's loops call with keywords; positional calls bound by name
        if "prompt_ids" not in sent:
            sent.update(self._signature.bind_partial(*args, **kwargs).arguments)
        self._calls += 1
        routes = out.routed_experts
        arr = np.zeros((0, 0, 0), dtype=np.int16) if routes is None else np.asarray(routes).astype(np.int16)
        os.makedirs(self._log_dir, exist_ok=True)
        name = f"call_a{os.getpid()}_{time.monotonic_ns()}_{self._calls}.pt"
        torch.save({"request_id": str(sent.get("request_id")),
                    "global_steps": (getattr(out, "extra_fields", None) or {}).get("global_steps"),
                    "prompt_ids": [int(t) for t in sent["prompt_ids"]], "output_ids": [int(t) for t in out.token_ids],
                    "routed_experts": torch.from_numpy(arr), "routes_returned": routes is not None,
                    "routes_dtype": None if routes is None else str(np.asarray(routes).dtype),
                    "stop_reason": out.stop_reason,
                    "num_cached_tokens": (getattr(out, "extra_fields", None) or {}).get("num_cached_tokens")},
                   os.path.join(self._log_dir, name))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Recording:
    """Wraps the loop's server client in a :class:`CallRecorder` when ``R3E2E_AGENT_LOG_DIR`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        log_dir = os.environ.get(AGENT_LOG_ENV)
        if log_dir:
            self.server_manager = CallRecorder(self.server_manager, log_dir)


class RecordingSingleTurn(_Recording, HandleSingleTurnAgentLoop):
    pass


@ToolParser.register("r3e2e")
class AlwaysCallParser(ToolParser):
    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids)
        return text, [FunctionCall(name=TOOL_NAME, arguments="{}")]


class CappedFirstSeen(_Recording, FirstSeenToolAgentLoop):
    first_seen = True

    async def _handle_generating_state(self, agent_data: Any, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> Any:
        return await super()._handle_generating_state(agent_data, {**sampling_params, "max_tokens": TURN_TOKENS},
                                                      ignore_termination)


class CappedLastCall(CappedFirstSeen):
    first_seen = False


def tool_config_yaml() -> str:
    return f"""tools:
  - class_name: verl.tools.base_tool.BaseTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: {TOOL_NAME}
        description: look a word up
        parameters:
          type: object
          properties: {{}}
          required: []
"""


def agent_loop_yaml(first_seen: bool) -> str:
    cls = "CappedFirstSeen" if first_seen else "CappedLastCall"
    return f"""- name: {TOOL_AGENT}
  _target_: {__name__}.{cls}
- name: {SINGLE_TURN}
  _target_: {__name__}.RecordingSingleTurn
"""
