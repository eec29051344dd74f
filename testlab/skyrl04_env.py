"""Running SkyRL 0.4.0's ``MegatronModelWrapper`` without Megatron-Bridge (tests, and the GPU scripts).

SkyRL 0.4.0's wrapper imports two functions from ``megatron.bridge.peft.utils`` at module level
(``skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:8-10``) that exist in **no
released Megatron-Bridge**: 0.6.2, the newest on PyPI (2026-11-26), has neither (its
``peft/utils.py`` was searched; the GPU run of 2026-11-26 stopped there with ``ImportError: cannot
import name 'enable_expert_parallel_grad_sync_in_finalize'``); SkyRL's metadata asks for an
unversioned ``megatron-bridge``. On a CPU machine Megatron-Bridge cannot import at all (it imports
Transformer Engine). The two functions:

* ``enable_expert_parallel_grad_sync_in_finalize(modules)``: drops Megatron-Bridge's per-micro-batch
  grad-sync hooks of *shared-expert LoRA adapters*; without LoRA there is nothing to drop, so the
  stand-in does nothing.
* ``finalize_model_grads_with_expert_adapter_sync(model, num_tokens)``: megatron's
  ``finalize_model_grads`` plus an all-reduce of those LoRA adapters' grads over expert parallelism;
  without LoRA adapters it is megatron's ``finalize_model_grads``, which the stand-in calls.

Everything else is SkyRL 0.4's own code. :func:`apply` registers the stand-ins in the calling
process (a spawned rank) only when ``megatron.bridge`` cannot be imported (never over a real one):
the GPU scripts run SkyRL with a megatron-core >= 0.17 site that holds no Megatron-Bridge, and
report ``megatron_bridge_stand_in``. No LoRA is used, so nothing SkyRL does with batches, micro-batches
or gradients differs. SkyRL 0.4 also needs megatron-core >= 0.17 (``PackedSeqParams(total_tokens=...)``,
``skyrl/backends/skyrl_train/distributed/megatron/megatron_utils.py:810``).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Optional

__all__ = ["apply"]


def _finalize(model: Any, num_tokens: Optional[Any] = None) -> None:
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, num_tokens)


def apply() -> bool:
    """Register the stand-ins if ``megatron.bridge`` is not importable. Returns whether they are in
    place (also when an earlier call in this process registered them)."""
    registered = sys.modules.get("megatron.bridge.peft.utils")
    if registered is not None:
        return getattr(registered, "r3bridge_stand_in", False)
    if importlib.util.find_spec("megatron.bridge") is not None:
        return False
    for name in ("megatron.bridge", "megatron.bridge.peft"):
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so that the submodule below resolves
        sys.modules.setdefault(name, mod)
    utils = types.ModuleType("megatron.bridge.peft.utils")
    utils.__doc__ = "stand-in (testlab.skyrl04_env): no LoRA adapters, megatron's finalize_model_grads"
    utils.enable_expert_parallel_grad_sync_in_finalize = lambda modules: None
    utils.finalize_model_grads_with_expert_adapter_sync = _finalize
    utils.r3bridge_stand_in = True
    sys.modules["megatron.bridge.peft.utils"] = utils
    return True
