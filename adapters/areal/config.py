"""The ``r3bridge`` section for AReaL: an ``r3bridge:`` section in AReaL's own YAML / command line.

AReaL's way for an integration to add config fields is a subclass of its experiment config parsed by
its own ``load_expr_config`` (AReaL's multi-turn example does exactly this with ``GRPOConfig``).
:func:`grpo_config_class` is that subclass: ``GRPOConfig`` (or any AReaL experiment config) plus a
field ``r3bridge`` of type :class:`r3bridge.ReplayConfig` (``None`` when the YAML and the command
line leave it out), so AReaL's parser type-checks ``r3bridge.replay_mode: R3`` in the YAML or
``r3bridge.replay_mode=R3`` on the command line and refuses unknown keys. The trainer
(:func:`r3bridge.adapters.areal.trainer_class`) reads it from the config it is given.

``R3BRIDGE_CONFIG`` (JSON) / ``R3BRIDGE_REPLAY_MODE`` fill the keys the section leaves unset
(the actor's :class:`r3bridge.megatron.AdapterSession` merges them; a key set differently in
both is refused); with neither, replay
is off, and the adapter says so at startup.

Also here: :func:`check_routes_topk`, the top-k check at ingest (before any reshape), naming the
sample, token, layer and both top-k values.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Sequence

from r3bridge.config import ReplayConfig
from r3bridge.errors import RouteShapeError
from r3bridge.hf import ModelInfo  # what the adapter needs to know about the model (re-exported)
from r3bridge.job_check import with_replay_section

__all__ = ["replay_config", "grpo_config_class", "parse_cli", "section_of",
           "check_routes_topk", "ModelInfo"]


def replay_config(cfg: ReplayConfig | Mapping[str, Any] | None = None) -> ReplayConfig:
    """An explicit config, else ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, else off."""
    return ReplayConfig.resolve(cfg)


@functools.lru_cache(maxsize=None)
def grpo_config_class(base: Optional[type] = None) -> type:
    """``base`` (default AReaL's ``GRPOConfig``) plus ``r3bridge: Optional[ReplayConfig] = None``."""
    if base is None:
        from r3bridge.adapters.areal._compat import import_areal
        base = import_areal("areal.api.cli_args").GRPOConfig
    return with_replay_section(base, module=__name__)


def parse_cli(argv: Sequence[str], config_cls: Optional[type] = None) -> Any:
    """``--config x.yaml key=value ...`` parsed exactly as AReaL's ``load_expr_config`` parses it
    (``parse_cli_args`` -> ``to_structured_cfg`` -> ``OmegaConf.to_object``), without its side effects
    (name-resolve set-up, saving the config). For a job, call AReaL's ``load_expr_config(argv,
    grpo_config_class())`` itself."""
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from r3bridge.adapters.areal._compat import import_areal
    cli_args = import_areal("areal.api.cli_args")
    try:
        cfg, _ = cli_args.parse_cli_args(list(argv))
    finally:   # AReaL initialises hydra globally and leaves it so: a later hydra user would fail
        GlobalHydra.instance().clear()
    return OmegaConf.to_object(cli_args.to_structured_cfg(cfg, config_cls=config_cls or grpo_config_class()))


def section_of(experiment_config: Any) -> Optional[ReplayConfig]:
    """The ``r3bridge`` section of a parsed AReaL experiment config (``None``: not set)."""
    section = getattr(experiment_config, "r3bridge", None)
    if section is None:
        return None
    return section if isinstance(section, ReplayConfig) else ReplayConfig.from_mapping(section)


def check_routes_topk(routes: Any, *, num_layers: int, topk: int, sample: Any, turn: int = 0) -> None:
    """One SGLang response's ``routed_experts`` as AReaL decodes it (``[token rows, num_layers * K]``)
    against the model's top-k, before anything reshapes it. ``RouteShapeError`` naming the sample,
    the first token and layer that cannot be read, and both top-k values."""
    shape = tuple(getattr(routes, "shape", ()))
    if len(shape) != 2:
        return                                   # base64 or None: the decoder checks those
    rows, width = int(shape[0]), int(shape[1])
    if width == num_layers * topk:
        return
    theirs = f"top-{width // num_layers}" if width % num_layers == 0 else f"{width} ids per token row"
    raise RouteShapeError(
        f"AReaL sample {sample}, turn {turn}: routes at token 0, layer 0 (and every one of the {rows} token "
        f"rows) carry {theirs} ({width} ids per token for {num_layers} layers); the model's config says "
        f"top-{topk} (num_experts_per_tok): the rollout engine serves another model or config")

