"""The ``r3bridge:`` section in AReaL's own YAML / command line: :func:`grpo_config_class` adds it
to AReaL's experiment config as a typed field. docs/use-with-areal.md, "Configuration".
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from r3bridge.job_check import with_replay_section

__all__ = ["grpo_config_class", "parse_cli"]


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
