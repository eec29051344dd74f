"""r3bridge for verl 0.9: ``replay_mode: R2 | R3 | off`` in an existing Megatron job (docs/use-with-verl.md).

Loaded in the driver and every Ray worker (verl's plugin entry points or ``external_lib``); opt-in:
r3bridge's engine is registered (``registry.py``) only when the launcher's mode is R2 or R3. In a
process that runs one of verl's own entry points, a launch that asks for r3bridge is refused here,
before verl composes its config and starts Ray (``stock_launch.py``): only r3bridge's launcher
(``main_ppo.py``) reads the ``r3bridge`` section.
"""
from __future__ import annotations

from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, VerlCodec
from r3bridge.adapters.verl.config import prepare_verl_config, validate_verl_config
from r3bridge.adapters.verl.registry import ENGINE_KEY, register, requested_mode
from r3bridge.adapters.verl.rollout import VerlRollout
from r3bridge.adapters.verl.stock_launch import LAUNCHER_MODULE, main_module, refuse_if_asked
from r3bridge.announce import ensure_visible

ensure_visible()        # the INFO lines reach a handler (verl's root logger sits at WARNING)
_main = main_module()
if _main is not None and _main[0] == LAUNCHER_MODULE:
    pass                # r3bridge's launcher: checks first, registers in prepare_verl_config (after verl's import)
else:
    refuse_if_asked()   # verl's own launcher asked for r3bridge: refused (it would train without it)
    if requested_mode() != "off":       # opt-in: replay off imports nothing more and registers nothing
        register()

__all__ = ["ENGINE_KEY", "ROUTES_KEY", "SAMPLE_KEY", "VerlCodec", "VerlRollout", "register", "validate_verl_config",
           "prepare_verl_config"]
