"""A launcher that composes a framework's hydra job config itself, as the framework's own
``@hydra.main`` would, with the ``r3bridge`` section on the same command line."""
from __future__ import annotations

import sys
from typing import Any, Callable

from r3bridge.launch.steps import section_overrides

__all__ = ["run_hydra_job"]


def run_hydra_job(config_dir: str, config_name: str, body: Callable[[Any], None]) -> None:
    """``body(config)`` on the config hydra composes from ``config_dir`` / ``config_name`` and this
    process's command line, ``r3bridge.x=y`` passed to hydra as ``++r3bridge.x=y``
    (:func:`~r3bridge.launch.steps.section_overrides`); hydra names the job after ``body``'s module."""
    import hydra

    sys.argv = [sys.argv[0], *section_overrides(sys.argv[1:])]
    hydra.main(config_path=config_dir, config_name=config_name, version_base=None)(body)()
