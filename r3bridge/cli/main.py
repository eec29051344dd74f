"""``r3bridge`` command line entry point (``[project.scripts] r3bridge = r3bridge.cli.main:main``).

Subcommands live in their own modules, each with ``add_parser(subparsers)`` and ``run(args) -> int``:

* ``inspect``  r3bridge/cli/inspect_cmd.py
* ``diff``     r3bridge/cli/diff_cmd.py
* ``demo``     r3bridge/cli/demo.py (optional, see the DEMO HOOK below)
* ``evidence`` r3bridge/cli/evidence.py (optional, like ``demo``)

Exit codes: 0 success, 2 bad input (``error: ...`` on one line on stderr; argparse usage errors
exit 2 as well).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from r3bridge import __version__
from r3bridge.cli import adapters_cmd, diff_cmd, inspect_cmd, new_adapter
from r3bridge.cli._common import CliError
from r3bridge.errors import ReplayError

_CORE_COMMANDS = {inspect_cmd.NAME: inspect_cmd, diff_cmd.NAME: diff_cmd, new_adapter.NAME: new_adapter,
                  adapters_cmd.NAME: adapters_cmd}

# ----------------------------------------------------------------------------------- DEMO HOOK
# `r3bridge demo` lives in r3bridge/cli/demo.py (owned by the Megatron side), which must provide
#     add_parser(subparsers) -> argparse.ArgumentParser   # registers the "demo" subparser
#     run(args) -> int                                     # exit code
# It is imported lazily and only when the command line may need it (not for `inspect` / `diff`),
# and registered only if it imports: a missing or broken demo.py (or a missing megatron-core)
# never takes `inspect` / `diff` down. Keep heavy imports (megatron-core, torch.distributed set-up)
# inside demo.run() so `r3bridge --help` stays fast.
_OPTIONAL_COMMANDS = ("demo", "evidence")


def _load_optional(name: str):
    """(module, None) if r3bridge.cli.<name> imports and has add_parser/run, else (None, reason)."""
    try:
        mod = importlib.import_module(f"r3bridge.cli.{name}")
    except Exception as e:  # noqa: BLE001 - any import failure just leaves the command out
        return None, f"{type(e).__name__}: {e}"
    if not (callable(getattr(mod, "add_parser", None)) and callable(getattr(mod, "run", None))):
        return None, f"r3bridge.cli.{name} lacks add_parser(subparsers) / run(args)"
    return mod, None


def _first_positional(argv: Sequence[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def build_parser(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser and {command: handler module}. Optional commands are loaded unless ``argv``
    names a core command."""
    parser = argparse.ArgumentParser(
        prog="r3bridge",
        description="MoE routing replay (R2 / R3) for RL trainers on Megatron: inspect and compare "
                    "saved route sets, run the demo.")
    parser.add_argument("--version", action="version", version=f"r3bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    handlers: dict = {}
    for name, mod in _CORE_COMMANDS.items():
        mod.add_parser(sub)
        handlers[name] = mod.run
    first = _first_positional(argv or [])
    for name in _OPTIONAL_COMMANDS:
        if first in _CORE_COMMANDS:
            break  # `inspect` / `diff` never import the optional modules
        mod, reason = _load_optional(name)
        if mod is not None:
            mod.add_parser(sub)
            handlers[name] = mod.run
        else:
            p = sub.add_parser(name, help=f"(unavailable: {reason})", add_help=False)
            p.set_defaults(_accept_extra=True)   # take any options, then explain
            handlers[name] = _unavailable(name, reason)
    return parser, handlers


def _unavailable(name: str, reason: str):
    def run(args) -> int:
        raise CliError(f"`r3bridge {name}` is unavailable: {reason}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, handlers = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_accept_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(handlers[args.command](args) or 0)
    except (CliError, ReplayError) as e:
        msg = " ".join(str(e).split())  # one line
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `r3bridge inspect f | head`
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
