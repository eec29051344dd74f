"""A launcher's first and last step around a framework's own launcher: the job config parsed as
the framework's script parses it (the ``r3bridge`` section refused or announced), and the
framework's launcher run as ``python -m`` runs it. The framework's parser, config class and
launcher module stay in the adapter's launcher."""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, Optional, Sequence, TypeVar

from r3bridge.announce import announce
from r3bridge.config import ReplayConfig
from r3bridge.job_check import replay_section
from r3bridge.launch.preflight import refuse, refusing_section_errors

__all__ = ["parse_announced", "run_framework_main"]

logger = logging.getLogger("r3bridge")
T = TypeVar("T")


def parse_announced(parse: Callable[[], T], where: str, *, config_class: str, checked_by: str,
                    section: str = "r3bridge") -> Optional[T]:
    """``parse()`` (the framework's parser with ``config_class`` plus ``section``): a bad value or
    key of the section refused in one line (:func:`~r3bridge.launch.refusing_section_errors`), the
    mode in force announced in ``where``. Any other parse error (the script's own config class has
    keys ``config_class`` lacks) is said in one WARNING line and gives ``None``: the section is
    then checked and announced by ``checked_by``."""
    try:
        with refusing_section_errors(section):
            config = parse()
    except Exception as e:  # noqa: BLE001 - the framework's parser (hydra, omegaconf) on another config class
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if section in str(e):
            refuse(f"{section}: {first}")
        logger.warning("r3bridge (%s): the config is not %s + %s (%s); its %s section is checked and announced "
                       "by %s", where, config_class, section, first, section, checked_by)
        return None
    announce(*ReplayConfig.resolve_with_origin(replay_section(config, section)), where)
    return config


def run_framework_main(main: Callable[[], Any], module_file: str, argv: Sequence[str], *,
                       stop: Optional[threading.Event] = None) -> None:
    """The framework's launcher ``main()`` with ``sys.argv`` as ``python -m`` sets it
    (``module_file``: the launcher module's file); a ``KeyboardInterrupt`` (the framework's
    launcher stops its jobs on it) ends it with exit status 1; ``stop`` (e.g. the event of
    :func:`~r3bridge.launch.watch_servers`) is set once it returns."""
    sys.argv = [module_file, *argv]
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(1) from None
    finally:
        if stop is not None:
            stop.set()
