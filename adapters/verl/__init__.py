"""r3bridge for verl 0.9: ``replay_mode: R2 | R3 | off`` in an existing Megatron job (docs/use-with-verl.md).

Loaded in the driver and every Ray worker (verl's plugin entry points or ``external_lib``); opt-in:
r3bridge's engine is registered (``registry.py``) only when the launcher's mode is R2 or R3.
"""
from __future__ import annotations

from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, VerlCodec
from r3bridge.adapters.verl.config import prepare_verl_config, validate_verl_config
from r3bridge.adapters.verl.registry import ENGINE_KEY, register
from r3bridge.adapters.verl.rollout import VerlRollout
from r3bridge.announce import ensure_visible
from r3bridge.launch.plugin_load import requested_mode

ensure_visible()        # the INFO lines reach a handler (verl's root logger sits at WARNING)
if requested_mode() != "off":       # opt-in: replay off imports nothing more and registers nothing
    register()

__all__ = ["ENGINE_KEY", "ROUTES_KEY", "SAMPLE_KEY", "VerlCodec", "VerlRollout", "register", "validate_verl_config",
           "prepare_verl_config"]
