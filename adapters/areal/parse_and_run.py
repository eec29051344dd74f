"""The AReaL launcher's first and last step around AReaL's own launcher: the job config parsed as the
guide's script parses it (the ``r3bridge`` section refused or announced), and AReaL's launcher run as
``python -m`` runs it. AReaL's parser, config class and launcher module stay in :mod:`.launch`."""
from __future__ import annotations

import logging
import re
import sys
import threading
from typing import Any, Callable, Optional, Sequence, TypeVar

from r3bridge.announce import announce
from r3bridge.config import ReplayConfig
from r3bridge.errors import ReplayError
from r3bridge.job_check import replay_section, section_key_problem
from r3bridge.launch.preflight import refuse

__all__ = ["parse_announced", "run_framework_main"]

logger = logging.getLogger("r3bridge")
T = TypeVar("T")
# omegaconf's ConfigKeyError: "Key 'x' not in 'Cls'\n    full_key: a.b.x ..."; hydra's override error
_UNKNOWN_KEY = re.compile(r"Key '([^']+)' not in '([^']+)'(?:.*?full_key: (\S+))?", re.S)
_OVERRIDE = re.compile(r"Could not override '([^']+)'")


def _section_problem(error: Exception, section: str) -> Optional[str]:
    """The one line for a parse error about the section's keys (``None``: not about the section)."""
    text = str(error)
    unknown, override = _UNKNOWN_KEY.search(text), _OVERRIDE.search(text)
    full_key = (unknown.group(3) or "") if unknown else (override.group(1) if override else "")
    if not full_key.startswith(f"{section}."):
        return None
    key = full_key[len(section) + 1:]
    problem = section_key_problem(key, section)
    if problem is None and override:      # a valid key the YAML does not have: hydra wants it added
        problem = (f"{full_key}: the YAML's {section} section has no key {key!r}, so hydra cannot override it: "
                   f"write ++{full_key}=... (hydra's add-or-override)")
    return problem or f"{section}: {text.splitlines()[0]}"


def parse_announced(parse: Callable[[], T], where: str, *, config_class: str, checked_by: str,
                    section: str = "r3bridge") -> Optional[T]:
    """``parse()`` (AReaL's parser with ``config_class`` plus ``section``): a bad value or key of the
    section refused in one line (a mistyped key with every valid key), the mode in force announced in
    ``where``. A key ``config_class`` lacks outside the section (the script's own config class
    extends it) is said in one WARNING line and gives ``None``: the section is then checked and
    announced by ``checked_by``. Any other parse error (a missing file, YAML syntax, a value AReaL's
    types refuse) is refused in one line: AReaL's own launcher would stop on it too."""
    try:
        config = parse()
    except ReplayError as e:      # a bad value of the section (ReplayConfig's own checks)
        refuse(f"{type(e).__name__}: " + (str(e) if section in str(e) else f"{section}: {e}"))
    except Exception as e:  # noqa: BLE001 - AReaL's parser (hydra, omegaconf, yaml, its asserts)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        problem = _section_problem(e, section)
        if problem:
            refuse(problem)
        unknown = _UNKNOWN_KEY.search(str(e))
        if unknown is None:
            refuse(f"AReaL's parser cannot read this job config: {type(e).__name__}: {first}")
        logger.warning("r3bridge (%s): the config has a key %s lacks (%s): the script's own config class reads it; "
                       "its %s section is checked and announced by %s", where, config_class, first, section,
                       checked_by)
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
