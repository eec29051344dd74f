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
  and a second turn inside ``response_length``.

The tool is verl's own ``BaseTool`` (its ``execute`` answers "Updated the tool state.").
"""
from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

from r3bridge.adapters.verl.agent_loop import FirstSeenToolAgentLoop

TURN_TOKENS = 8
TOOL_NAME = "lookup"


@ToolParser.register("r3e2e")
class AlwaysCallParser(ToolParser):
    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids)
        return text, [FunctionCall(name=TOOL_NAME, arguments="{}")]


class CappedFirstSeen(FirstSeenToolAgentLoop):
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
    return f"""- name: r3e2e_tool_agent
  _target_: {__name__}.{cls}
"""
