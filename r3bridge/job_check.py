"""A job's own settings, checked for replay: the rules every framework shares, written once.

Each framework spells them in its own keys, but the rules are the same: R3 needs the rollout engine to
return its routes, R2 records the trainer's own (rollout routes would collide with them); the
framework's own replay switch next to r3bridge's is two replays at once; the reference model
never replays; a vLLM / SGLang rollout reports every hidden layer. An adapter states its facts
to a :class:`JobCheck` and gets one :class:`~r3bridge.errors.ConfigError` listing every problem,
each naming the framework key and the fix. Replay off never complains.

Also here: :func:`environment_setting` (the r3bridge setting a process's environment carries,
refused naming the variable), :func:`setting` (a dotted key of a framework config, whatever its container),
:func:`interpolated` and :func:`with_replay_section` (a framework config class plus the ``r3bridge`` section, for
frameworks whose parser type-checks the job config).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from r3bridge.config import ENV_CONFIG, ENV_MODE, ReplayConfig, ReplayMode
from r3bridge.errors import ConfigError

__all__ = ["JobCheck", "setting", "interpolated", "with_replay_section", "environment_setting", "section_key_problem"]


def environment_setting(environ: Optional[Mapping[str, str]] = None) -> Optional[ReplayConfig]:
    """The section ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE`` set (``None``: neither is set),
    read before a launcher reads its job config: a bad value is a :class:`ConfigError` naming the
    variable(s) and their values, never blamed on the job config's section."""
    env = os.environ if environ is None else environ
    named = [f"{name}={env[name]!r}" for name in (ENV_CONFIG, ENV_MODE) if env.get(name)]
    if not named:
        return None
    try:
        return ReplayConfig.from_env(env)
    except ConfigError as e:
        raise ConfigError(f"environment ({', '.join(named)}): {e}") from None


def section_key_problem(key: str, section: str = "r3bridge") -> Optional[str]:
    """``None`` when ``key`` is an option of the section, else the line naming it and every valid key."""
    known = [f.name for f in dataclasses.fields(ReplayConfig)]
    if key in known:
        return None
    return f"{section}.{key} is not an r3bridge option; valid keys: {', '.join(known)}"


def setting(cfg: Any, path: str, default: Any = None, *, plain: bool = False) -> Any:
    """``a.b.c`` of a DictConfig / dict / dataclass; ``default`` when any part is missing.
    ``plain``: an OmegaConf node as plain Python (resolved), else the node itself (writable)."""
    cur = cfg
    for part in path.split("."):
        if cur is None:
            return default
        if isinstance(cur, Mapping) or hasattr(cur, "keys"):
            try:
                cur = cur.get(part, None)
            except Exception:  # noqa: BLE001  (omegaconf struct / interpolation errors)
                return default
        else:
            cur = getattr(cur, part, None)
    if cur is None:
        return default
    if not plain:
        return cur
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(cur):
            return OmegaConf.to_container(cur, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return cur


def interpolated(cfg: Any, path: str) -> bool:
    """Whether the dotted key ``path`` of an OmegaConf config is an interpolation (``${...}``): its
    value is another key's, which is the one the user wrote."""
    parent, _, key = path.rpartition(".")
    try:
        from omegaconf import OmegaConf
        node = setting(cfg, parent) if parent else cfg
        return OmegaConf.is_config(node) and OmegaConf.is_interpolation(node, key)
    except Exception:  # noqa: BLE001  (a plain dict / dataclass: no interpolation)
        return False


def with_replay_section(base: type, name: Optional[str] = None, module: Optional[str] = None) -> type:
    """``base`` (a framework's config dataclass) plus a field ``r3bridge: Optional[ReplayConfig] =
    None``: the framework's own parser then type-checks the section and refuses unknown keys."""
    return dataclasses.dataclass(type(name or f"R3Bridge{base.__name__}", (base,), {
        "__annotations__": {"r3bridge": Optional[ReplayConfig]},
        "r3bridge": None,
        "__module__": module or __name__,
    }))


class JobCheck:
    """The problems of one job config for ``config.replay_mode``; every rule a no-op with replay
    off. ``section``: where the job sets r3bridge (``"r3bridge"``, ``"trainer.r3bridge"``);
    ``where``: what is checked, for the message; ``true`` / ``false``: how the framework spells
    booleans on its command line. Rules return ``self``, so checks chain."""

    def __init__(self, config: ReplayConfig, section: str, where: str, *, true: str = "True",
                 false: str = "False") -> None:
        self.config, self.section, self.where = config, section, where
        self.true, self.false = true, false
        self.problems: list[str] = []

    @property
    def _on(self) -> bool:
        return self.config.replay_mode is not ReplayMode.OFF

    def _mode(self) -> str:
        return f"{self.section}.replay_mode={self.config.replay_mode.value}"

    def refuse(self, when: Any, problem: str) -> "JobCheck":
        """A framework-specific problem (``when`` true, replay on)."""
        if self._on and when:
            self.problems.append(problem)
        return self

    def rollout_routes(self, key: str, returned: Optional[bool], *, engine: str = "vLLM / SGLang") -> "JobCheck":
        """``key`` makes the rollout engine return its routes (``None``: not known here)."""
        mode = self.config.replay_mode
        if returned is False and mode is ReplayMode.R3:
            self.problems.append(f"{key}={self.false}: R3 replays the rollout engine's routes: set "
                                 f"{key}={self.true} so {engine} return them")
        if returned and mode is ReplayMode.R2:
            self.problems.append(f"{key}={self.true}: R2 records the trainer's own routes, but {key}={self.true} "
                                 f"asks {engine} for rollout routes, which would collide with them: set it to "
                                 f"{self.false} (or use replay_mode=R3)")
        return self

    def framework_replay(self, key: str, value: Any, *, off: Any) -> "JobCheck":
        """The framework's own routing replay, which must stay ``off`` beside r3bridge's."""
        if self._on and value is not None and value != off:
            self.problems.append(f"{self._mode()} and {key}={self._spell(value)} ask for two replays at once: "
                                 f"{self.section}.replay_mode is the one switch; leave {key}={self._spell(off)}")
        return self

    def reference_replay(self, key: str, value: Any, *, off: Any) -> "JobCheck":
        """The reference model's replay setting: the reference model never replays."""
        if self._on and value is not None and value != off:
            self.problems.append(f"{key}={self._spell(value)}: the reference model never replays, only the actor "
                                 f"replays ({self._mode()}): leave {key}={self._spell(off)}")
        return self

    def all_hidden_layers(self, engine: str) -> "JobCheck":
        """The rollout engine (vLLM, SGLang) reports every hidden layer: ``layer_axis=moe_only``
        cannot be honoured, and is refused rather than ignored."""
        if self._on and self.config.layer_axis == "moe_only":
            self.problems.append(f"{self.section}.layer_axis=moe_only: the rollout engine ({engine}) reports "
                                 f"every hidden layer: leave it null or all_hidden")
        return self

    def moe_model(self, moe_layer_ids: Optional[list[int]]) -> "JobCheck":
        if self._on and moe_layer_ids is not None and not moe_layer_ids:
            self.problems.append(f"the model is not MoE (no MoE layer in its HF config): {self._mode()} needs an "
                                 f"MoE model")
        return self

    def raise_if_any(self, error: type[Exception] = ConfigError) -> None:
        """``error`` (a :class:`~r3bridge.errors.ReplayError` subclass) listing every problem."""
        if self.problems:
            raise error(f"{self._mode()} cannot run with this {self.where}:\n  - " + "\n  - ".join(self.problems))

    def _spell(self, value: Any) -> str:
        if isinstance(value, bool):
            return self.true if value else self.false
        return repr(value)


def replay_section(holder: Any, name: str = "r3bridge") -> Optional[ReplayConfig]:
    """The section a parsed framework config carries in the field :func:`with_replay_section`
    added (a mapping is parsed; ``None``: not set)."""
    section = getattr(holder, name, None)
    if section is None:
        return None
    return section if isinstance(section, ReplayConfig) else ReplayConfig.from_mapping(section)
