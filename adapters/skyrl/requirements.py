"""What SkyRL's launch line needs from this environment, checked before any SkyRL module is imported:
otherwise the user meets SkyRL's import errors (``aiohttp``, ``torchdata``), its ``WANDB_API_KEY``
assertion, or each Ray worker dying on its first SkyRL import, one after another, before r3bridge
says what is missing. :func:`launch_problem` says every unmet :class:`Requirement` in one line.

Nothing here imports SkyRL: the command line is read as text (the keys SkyRL's parser would read).
"""
from __future__ import annotations

import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["Requirement", "unmet", "launch_problem", "command_line_value", "INSTALL_LINE"]

# what the guide's install line adds to SkyRL's own: its `megatron` extra brings neither aiohttp (SkyRL 0.3:
# no vLLM in that extra) nor, through skyrl-train, anything else the launcher imports that it lacks
INSTALL_LINE = 'pip install "skyrl[megatron]" aiohttp torchdata'


@dataclass(frozen=True)
class Requirement:
    """``why``: said when unmet; ``python``: at least this ``(major, minor)``; ``module``: importable."""

    why: str
    python: Optional[tuple[int, int]] = None
    module: Optional[str] = None

    def met(self) -> bool:
        if self.python is not None and sys.version_info < self.python:
            return False
        return self.module is None or importlib.util.find_spec(self.module) is not None


def unmet(requirements: Sequence[Requirement], *, lead: str, remedy: str) -> Optional[str]:
    """``"{lead}: {why}; {why}. {remedy}"`` over the unmet requirements; ``None`` when all are met."""
    reasons = [r.why for r in requirements if not r.met()]
    return f"{lead}: {'; '.join(reasons)}. {remedy}" if reasons else None


def _missing(module: str, importer: str) -> Requirement:
    return Requirement(f"{importer} imports {module}, which is not installed", module=module)


# what r3bridge's SkyRL launcher imports from SkyRL before Ray starts (its config, main_base, the
# trainer), by the packages SkyRL's base install does not bring
LAUNCHER_NEEDS = (
    _missing("skyrl", "r3bridge's SkyRL launcher"),
    _missing("skyrl_gym", "SkyRL's config (skyrl.train.config)"),
    _missing("aiohttp", "SkyRL's config and entry point (skyrl.backends.skyrl_train.inference_servers."
                        "remote_inference_client)"),
    _missing("torchdata", "SkyRL's trainer (skyrl.train.utils.trainer_utils: torchdata.stateful_dataloader)"),
    _missing("ray", "SkyRL's entry point (skyrl.train.entrypoints.main_base)"),
    _missing("loguru", "SkyRL's entry point"),
    _missing("jaxtyping", "SkyRL's training utilities"),
)

# what SkyRL's Megatron workers import (each Ray worker would die on it, one after another)
MEGATRON_WORKERS_NEED = (
    # skyrl.backends' __init__ -> skyrl.tinker.types: pydantic models over typing.TypedDict, which
    # pydantic refuses before 3.12; every Ray worker imports SkyRL's classes the normal way
    Requirement(f"SkyRL's package does not import on Python {platform.python_version()} (pydantic: \"Please use "
                "typing_extensions.TypedDict instead of typing.TypedDict on Python < 3.12\", from "
                "skyrl.tinker.types), and its Ray workers import it", python=(3, 12)),
    # megatron_worker.py imports AutoBridge at module level (0.4.0's megatron_model_wrapper.py too);
    # SkyRL 0.3/0.4's megatron extra declares megatron-bridge for Python >= 3.12 only
    Requirement("SkyRL's Megatron worker imports megatron.bridge (Megatron-Bridge), which is not installed; "
                "SkyRL's `megatron` extra installs it on Python >= 3.12 only", module="megatron.bridge"),
)

# SkyRL's TrainerConfig defaults (0.3.0 and 0.4.0), for keys the command line does not set
_DEFAULTS = {"trainer.strategy": "fsdp", "trainer.logger": "wandb"}


def command_line_value(argv: Sequence[str], key: str) -> str:
    """The last ``key=value`` (``+`` / ``++`` allowed) of a SkyRL command line, else SkyRL's default."""
    found = _DEFAULTS.get(key, "")
    for arg in argv:
        name, eq, value = arg.lstrip("+").partition("=")
        if eq and name == key:
            found = value.strip("'\"")
    return found


def launch_problem(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why SkyRL's job on this command line cannot start in this environment, in one line (``None``:
    nothing r3bridge can see): the launcher's imports, the Megatron workers' Python and modules, and
    the ``WANDB_API_KEY`` SkyRL's ``validate_cfg`` asserts for its default logger."""
    env = os.environ if environ is None else environ
    megatron = command_line_value(argv, "trainer.strategy") == "megatron"
    needs = [*LAUNCHER_NEEDS, *(MEGATRON_WORKERS_NEED if megatron else ())]
    reasons = [r.why for r in needs if not r.met()]
    if command_line_value(argv, "trainer.logger") == "wandb" and not env.get("WANDB_API_KEY"):
        reasons.append("trainer.logger=wandb (SkyRL's default) needs WANDB_API_KEY in the environment (SkyRL's "
                       "validate_cfg asserts it): set it, or trainer.logger=console")
    if not reasons:
        return None
    return (f"SkyRL's {'Megatron ' if megatron else ''}job cannot start here: {'; '.join(reasons)}. Run it on "
            f"Python 3.12 in SkyRL's training environment ({INSTALL_LINE}); docs/use-with-skyrl.md, \"Install\"")
