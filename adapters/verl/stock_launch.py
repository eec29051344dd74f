"""verl's own entry points (``python -m verl.trainer.main_ppo``, ...) asked for replay: refused.

verl's launchers do not read an ``r3bridge`` section: a job started with ``+r3bridge.replay_mode=R3``
(or a YAML section, or ``R3BRIDGE_*`` in the environment or in Ray's runtime env) would train with
replay off, or on without r3bridge's launch checks. The adapter is a ``verl.plugins`` entry point,
which ``import verl`` loads before verl's launcher composes its config and long before Ray starts,
so :func:`refuse_if_asked` runs there: in a process whose ``__main__`` is a verl entry point, any
way of asking for r3bridge ends the launch with one ``error:`` line naming r3bridge's launcher,
``python -m r3bridge.adapters.verl.main_ppo``, which takes the same arguments. (With verl's plugins
off, ``VERL_USE_EXTERNAL_PLUGINS=none``, nothing of r3bridge runs in verl's launcher at all.)
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Sequence

from r3bridge.config import ENV_CONFIG, ENV_FROM, ENV_MODE, ReplayConfig, check_environment
from r3bridge.errors import ConfigError
from r3bridge.launch import refuse

__all__ = ["LAUNCHER_MODULE", "main_module", "verl_entry_point", "asked_for_r3bridge", "refuse_if_asked"]

logger = logging.getLogger("r3bridge.adapters.verl")
LAUNCHER_MODULE = "r3bridge.adapters.verl.main_ppo"
LAUNCHER = f"python -m {LAUNCHER_MODULE}"
_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}      # the interpreter's, before -m / the script
_CONFIG_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name",
                 "--config-dir": "dir", "-cd": "dir"}


def main_module(orig_argv: Optional[Sequence[str]] = None) -> Optional[tuple[str, list[str]]]:
    """(the module this process runs as ``__main__``, its arguments): ``python -m x.y`` or a script
    (named from its path: ``.../verl/trainer/main_ppo.py`` is ``verl.trainer.main_ppo``); ``None``
    for ``-c`` or an interactive interpreter. Read from ``sys.orig_argv``: a plugin loads while
    ``python -m`` still imports the module's package, before ``sys.argv`` is set."""
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    skip = False
    for i, arg in enumerate(argv[1:], start=1):
        if skip:                             # the value of an interpreter option (-X dev, -W error)
            skip = False
            continue
        if arg in _OPTIONS_WITH_VALUE:
            skip = True
            continue
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1], argv[i + 2:]
        if arg == "-c":
            return None
        if not arg.startswith("-"):          # the script
            parts = os.path.normpath(arg).split(os.sep)
            if "verl" in parts and arg.endswith(".py"):
                return ".".join(parts[len(parts) - 1 - parts[::-1].index("verl"):])[:-3], argv[i + 1:]
            return os.path.basename(arg)[:-3] if arg.endswith(".py") else arg, argv[i + 1:]
    return None


def verl_entry_point(orig_argv: Optional[Sequence[str]] = None) -> Optional[tuple[str, list[str]]]:
    """:func:`main_module` when it is one of verl's training launchers (``verl.trainer.*``, or a
    ``verl.*`` module whose name ends in ``main`` / holds ``main_ppo``: the recipes' launchers); else
    ``None`` (verl's tools, e.g. ``verl.model_merger``, are not asked)."""
    main = main_module(orig_argv)
    if main is None or not main[0].startswith("verl."):
        return None
    last = main[0].rsplit(".", 1)[-1]
    return main if main[0].startswith("verl.trainer.") or last.endswith("main") or "main_ppo" in last else None


def _split(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """hydra's config flags (``path`` / ``name`` / ``dir``) and the overrides of a command line."""
    flags: dict[str, str] = {}
    overrides: list[str] = []
    it = iter(args)
    for arg in it:
        flag, _, value = arg.partition("=")
        if flag in _CONFIG_FLAGS:
            flags[_CONFIG_FLAGS[flag]] = value if _ else next(it, "")
        elif not arg.startswith("-"):
            overrides.append(arg)
    return flags, overrides


def _composed_section(module: str, flags: dict[str, str], overrides: list[str]) -> list[str]:
    """Where the config verl's ``main_ppo`` will compose (hydra's compose API, same config folder,
    name and overrides) asks for r3bridge: an ``r3bridge`` section, ``R3BRIDGE_*`` in Ray's worker environment."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    verl_dir = os.path.dirname(os.path.abspath(importlib.util.find_spec("verl").origin))
    main_dir = os.path.join(verl_dir, *module.split(".")[1:-1])
    path = flags.get("path", "config")
    config_dir = path if os.path.isabs(path) else next(
        (d for d in (os.path.join(main_dir, path), os.path.abspath(path)) if os.path.isdir(d)), os.path.join(main_dir, path))
    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    if flags.get("dir"):
        kept.append(f"hydra.searchpath=[file://{os.path.abspath(flags['dir'])}]")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=flags.get("name", "ppo_trainer"), overrides=kept)
    env_vars = (((cfg.get("ray_kwargs") or {}).get("ray_init") or {}).get("runtime_env") or {}).get("env_vars") or {}
    found = {f"ray_kwargs.ray_init.runtime_env.env_vars.{k}" for k in env_vars if str(k).startswith("R3BRIDGE_")}
    if "r3bridge" in cfg:
        found.add("an r3bridge section in the job config")
    return sorted(found)


def asked_for_r3bridge(module: str, args: Sequence[str], environ: Optional[dict] = None) -> list[str]:
    """Every way this verl launch asks for r3bridge: ``r3bridge.*`` / ``R3BRIDGE_*`` overrides, a
    section in the composed job config (``main_ppo`` with a config of the user's), replay asked in
    the environment."""
    env = os.environ if environ is None else environ
    flags, overrides = _split(args)
    keys = [(o, o.lstrip("+~").partition("=")[0]) for o in overrides]
    asked = [o for o, key in keys if key == "r3bridge" or key.startswith("r3bridge.") or "R3BRIDGE_" in key]
    # R3BRIDGE_CONFIG_FROM: the section r3bridge's own launcher forwards to the processes it starts
    if (env.get(ENV_CONFIG) or env.get(ENV_MODE)) and not env.get(ENV_FROM):
        mode = ReplayConfig.from_env({k: env[k] for k in (ENV_CONFIG, ENV_MODE) if env.get(k)}).replay_mode.value
        if mode != "off":
            asked.append(f"replay_mode={mode} in the environment ({', '.join(k for k in (ENV_CONFIG, ENV_MODE) if env.get(k))})")
    if not asked and module == "verl.trainer.main_ppo" and flags:       # verl's default config has no section
        try:
            asked += _composed_section(module, flags, overrides)
        except Exception as e:  # noqa: BLE001  (hydra's own launch will say what is wrong with the config)
            logger.warning("r3bridge: could not compose verl's job config to look for an r3bridge section (%s: %s); "
                           "replay through r3bridge needs %s", type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                           LAUNCHER)
    return asked


def refuse_if_asked(orig_argv: Optional[Sequence[str]] = None, environ: Optional[dict] = None) -> None:
    """In one of verl's entry points, refuse a launch that asks for r3bridge (exit status 2)."""
    entry = verl_entry_point(orig_argv)
    if entry is None:
        return
    module, args = entry
    try:
        check_environment(environ)
    except ConfigError as e:
        refuse(f"{type(e).__name__}: {e}")
    asked = asked_for_r3bridge(module, args, environ)
    if asked:
        refuse(f"{module} (verl's own launcher) does not read r3bridge's settings, so replay would not be what "
               f"you asked for ({'; '.join(asked)}). Run r3bridge's launcher with the same arguments: {LAUNCHER} "
               f"... r3bridge.replay_mode=R3 (docs/use-with-verl.md)")
