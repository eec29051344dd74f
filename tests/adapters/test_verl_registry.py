"""The adapter loads through verl's plugin entry point / external_lib and owns the registry key."""
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
    import r3bridge.adapters.verl as adapter
    from verl.workers.engine import EngineRegistry, MegatronEngineWithLMHead, MegatronEngineWithValueHead

    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine

    assert adapter.LOADED and adapter.LOAD_ERROR is None
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
    import r3bridge.adapters.verl as adapter
    from verl.workers.engine.base import EngineRegistry

    slot = EngineRegistry._engines["language_model"]["megatron"]
    monkeypatch.setitem(slot, ("cuda", "nvidia"), object)
    monkeypatch.setattr(adapter, "LOADED", False)
    monkeypatch.setattr(adapter, "LOAD_ERROR", None)
    monkeypatch.setattr(adapter.logger, "propagate", True)
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)       # replay off: logged, not raised
    with caplog.at_level(logging.ERROR, logger="r3bridge.adapters.verl"):
        adapter._register()
    assert not adapter.LOADED and "not the r3bridge engine" in adapter.LOAD_ERROR
    assert any("NOT loaded" in r.getMessage() for r in caplog.records)


def test_failed_registration_fails_the_worker_when_replay_was_asked_for(monkeypatch):
    # verl's external_lib import lets this ImportError fail the worker instead of training without replay
    import r3bridge.adapters.verl as adapter
    from verl.workers.engine.base import EngineRegistry

    slot = EngineRegistry._engines["language_model"]["megatron"]
    monkeypatch.setitem(slot, ("cuda", "nvidia"), object)
    monkeypatch.setattr(adapter, "LOADED", False)
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "R3")
    with pytest.raises(ImportError, match="replay_mode=R3: RuntimeError: EngineRegistry holds"):
        adapter._register()
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "off")
    adapter._register()                                      # replay off: logged only
    assert not adapter.LOADED


_PROBE = (
    "import sys, verl\n"
    "loaded = 'r3bridge.adapters.verl' in sys.modules\n"
    "if not loaded:\n"
    "    from verl.utils.import_utils import import_external_libs\n"
    "    import_external_libs('r3bridge.adapters.verl')\n"
    "import r3bridge.adapters.verl as a\n"
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
