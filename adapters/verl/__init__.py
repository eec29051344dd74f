"""r3bridge for verl 0.9: ``replay_mode: R2 | R3 | off`` in an existing Megatron job.

Loaded in the driver and every Ray worker through verl's plugin entry points (``verl.plugins``) or
``actor_rollout_ref.model.external_lib``. Opt-in: only when the mode the launcher hands every
worker (``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``) is R2 or R3 is r3bridge's engine registered
(``registry.py``); replay off leaves verl untouched. Files as in every adapter (docs/porting.md),
plus ``main_ppo.py`` (the launcher) and ``agent_loop.py`` (the first-seen tool agent loop).
docs/use-with-verl.md.
"""
from __future__ import annotations

from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, VerlCodec
from r3bridge.adapters.verl.config import (
    ENV_VAR,
    check_engine_config,
    prepare_verl_config,
    replay_config_from_env,
    replay_config_from_verl,
    validate_verl_config,
)
from r3bridge.adapters.verl.registry import ENGINE_KEY, register
from r3bridge.adapters.verl.rollout import VerlRollout
from r3bridge.announce import ensure_visible
from r3bridge.launch.plugin_load import requested_mode

ensure_visible()        # the INFO lines reach a handler (verl's root logger sits at WARNING)
if requested_mode() != "off":       # opt-in: replay off imports nothing more and registers nothing
    register()

__all__ = ["ENGINE_KEY", "ENV_VAR", "ROUTES_KEY", "SAMPLE_KEY", "VerlCodec", "VerlRollout", "register",
           "replay_config_from_env", "replay_config_from_verl", "validate_verl_config", "check_engine_config",
           "prepare_verl_config"]
