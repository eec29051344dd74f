"""SkyRL 0.3 / 0.4 entry point with r3bridge: r3bridge's checks, then SkyRL's own ``main_base`` with
three subclasses swapped in (:mod:`.experiment`) and the ``trainer.r3bridge`` section on SkyRL's
command line.

    python -m r3bridge.adapters.skyrl.main trainer.r3bridge.replay_mode=R3 <SkyRL's overrides>

Before any SkyRL module is imported, each refused in one line (exit status 2): a bad
``R3BRIDGE_REPLAY_MODE`` / ``R3BRIDGE_CONFIG`` (naming the variable), a mistyped ``trainer.r3bridge``
key (with every valid key) or value, then whatever the launch line and SkyRL's Megatron workers
need that this environment lacks (:func:`.requirements.launch_problem`). Then SkyRL's parser,
r3bridge's contradictions, SkyRL's ``validate_cfg``, Ray. docs/use-with-skyrl.md, "What runs where".
"""
from __future__ import annotations

import importlib
import sys

from r3bridge.adapters.skyrl.config import SECTION, command_line_section
from r3bridge.adapters.skyrl.requirements import launch_problem
from r3bridge.announce import announce, ensure_visible
from r3bridge.errors import ConfigError
from r3bridge.job_check import environment_setting
from r3bridge.launch import refuse, refusing_section_errors

WHERE = "SkyRL launcher"


def main() -> None:
    argv = sys.argv[1:]
    ensure_visible()                           # the mode line (replay off: a WARNING) with its level
    try:
        environment_setting()
    except ConfigError as e:                   # the environment's setting, named as such
        refuse(f"ConfigError: {e}")
    with refusing_section_errors(SECTION):     # a mistyped key (every valid key named) or value
        rc, origin = command_line_section(argv)
    announce(rc, origin, WHERE)
    problem = launch_problem(argv)
    if problem:
        refuse(problem)
    importlib.import_module("r3bridge.adapters.skyrl.experiment").run(argv)   # SkyRL's modules, only now


if __name__ == "__main__":
    main()
