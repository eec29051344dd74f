"""The adapter loads through verl's plugin entry point / external_lib, opts in only when the job asks
for replay, and then owns the registry key."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import verl  # noqa: E402,F401  (installed by `make install`: never skipped)


def test_registry_resolves_to_adapter_engine(monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
    from verl.workers.engine import EngineRegistry, MegatronEngineWithLMHead, MegatronEngineWithValueHead

    import r3bridge.adapters.verl.registry as adapter
    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine

    assert adapter.register() and adapter.LOADED and adapter.LOAD_ERROR is None
    assert adapter.register()                                # idempotent
    cls = EngineRegistry.get_engine_cls("language_model", "megatron")
    assert cls is R3BridgeMegatronEngine and issubclass(cls, MegatronEngineWithLMHead)
    # only the LM-head engine on cuda/nvidia is ours: the critic and other devices stay verl's
    assert EngineRegistry.get_engine_cls("value_model", "megatron") is MegatronEngineWithValueHead
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "metax")     # cuda-compatible vendor: falls back to cuda
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead
    # ours overrides exactly these verl methods
    own = {k for k in vars(R3BridgeMegatronEngine) if not k.startswith("__") and callable(getattr(cls, k))}
    assert {"initialize", "forward_backward_batch", "forward_step", "disable_adapter"} <= own


def test_failed_registration_is_logged_not_hidden(caplog, monkeypatch):
    from verl.workers.engine.base import EngineRegistry

    import r3bridge.adapters.verl.registry as adapter

    slot = EngineRegistry._engines["language_model"]["megatron"]
    monkeypatch.setitem(slot, ("cuda", "nvidia"), object)
    monkeypatch.setattr(adapter, "LOADED", False)
    monkeypatch.setattr(adapter, "LOAD_ERROR", None)
    monkeypatch.setattr(adapter.logger, "propagate", True)
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)       # replay off: logged, not raised
    with caplog.at_level(logging.ERROR, logger="r3bridge.adapters.verl"):
        adapter.register()
    assert not adapter.LOADED and "not the r3bridge engine" in adapter.LOAD_ERROR
    assert any("NOT loaded" in r.getMessage() for r in caplog.records)


def test_failed_registration_fails_the_worker_when_replay_was_asked_for(monkeypatch):
    # verl's external_lib import lets this ImportError fail the worker instead of training without replay
    from verl.workers.engine.base import EngineRegistry

    import r3bridge.adapters.verl.registry as adapter

    slot = EngineRegistry._engines["language_model"]["megatron"]
    monkeypatch.setitem(slot, ("cuda", "nvidia"), object)
    monkeypatch.setattr(adapter, "LOADED", False)
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "R3")
    with pytest.raises(ImportError, match="replay_mode=R3: RuntimeError: EngineRegistry holds"):
        adapter.register()
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "off")
    adapter.register()                                      # replay off: logged only
    assert not adapter.LOADED


_PROBE = (
    "import sys, verl\n"
    "loaded = 'r3bridge.adapters.verl' in sys.modules\n"
    "if not loaded:\n"
    "    from verl.utils.import_utils import import_external_libs\n"
    "    import_external_libs('r3bridge.adapters.verl')\n"
    "import r3bridge.adapters.verl.registry as a\n"
    "from verl.workers.engine import EngineRegistry\n"
    "print('PLUGIN', loaded, a.LOADED, EngineRegistry.get_engine_cls('language_model', 'megatron').__name__)\n"
)


@pytest.mark.slow
def test_fresh_processes_load_it_by_entry_point_and_by_external_lib():
    """What a Ray worker does: a fresh ``import verl`` (plugin group ``verl.plugins``), and with
    plugins disabled, verl's ``external_lib`` import. Both log the adapter's own load message."""
    env = dict(os.environ, VERL_ENGINE_DEVICE="cuda", VERL_ENGINE_VENDOR="nvidia", R3BRIDGE_REPLAY_MODE="R3")
    env.pop("R3BRIDGE_CONFIG", None)
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], env=dict(env, VERL_USE_EXTERNAL_PLUGINS=p),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in ("auto", "none")]
    outs = [p.communicate(timeout=600) for p in procs]
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err[-3000:]
        assert "r3bridge verl adapter loaded" in err + out and "'replay_mode': 'R3'" in err + out
    assert "PLUGIN True True R3BridgeMegatronEngine" in outs[0][0]     # entry point
    assert "PLUGIN False True R3BridgeMegatronEngine" in outs[1][0]    # external_lib


_IMPORT_COST = (
    "import sys, time\n"
    "t = time.perf_counter()\n"
    "import verl\n"
    "seconds = time.perf_counter() - t\n"
    "a = sys.modules.get('r3bridge.adapters.verl')\n"
    "r = sys.modules.get('r3bridge.adapters.verl.registry')\n"
    "print('PROBE', a is not None, 'megatron.core' in sys.modules, 'r3bridge.adapters.verl.hooks' in sys.modules,\n"
    "      bool(r and r.LOADED), f'{seconds:.2f}')\n"
)


def _import_verl(**env_vars: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("R3BRIDGE_CONFIG", "R3BRIDGE_REPLAY_MODE")}
    env.update(env_vars)
    p = subprocess.run([sys.executable, "-c", _IMPORT_COST], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("PROBE"))
    return line.split()[1:]


@pytest.mark.slow
# each cell is a fresh interpreter importing verl (~20 s on CI): the unset and the JSON spelling here;
# every spelling of "off" is ReplayMode.parse's (tests/core/test_config.py)
@pytest.mark.parametrize("env", [{}, {"R3BRIDGE_CONFIG": '{"replay_mode": "disabled"}'}], ids=["unset", "json"])
def test_import_verl_with_replay_off_costs_nothing(env):
    """verl loads r3bridge's entry point, which imports no megatron-core and registers nothing: verl's
    stock engine stays in the registry (the import time is printed for the record, not asserted)."""
    loaded_plugin, megatron, hooks, registered, _seconds = _import_verl(**env)
    assert loaded_plugin == "True"                        # the entry point did run
    assert (megatron, hooks, registered) == ("False", "False", "False")


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"R3BRIDGE_REPLAY_MODE": "R3"}, {"R3BRIDGE_CONFIG": '{"replay_mode": "R2"}'}],
                         ids=["R3", "R2-json"])
def test_import_verl_with_replay_on_registers_the_engine(env):
    loaded_plugin, megatron, hooks, registered, _seconds = _import_verl(**env)
    assert (loaded_plugin, megatron, hooks, registered) == ("True", "True", "True", "True")
