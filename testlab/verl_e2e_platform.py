"""verl's NVIDIA platform with gloo instead of NCCL, for verl jobs on CPU-only Ray workers (tests).

Loaded in every process that imports verl through ``VERL_USE_EXTERNAL_MODULES`` (verl's own hook,
``verl/__init__.py``) and selected with ``VERL_PLATFORM=r3bridge_cpu`` (verl's
``PlatformRegistry``, ``verl/plugin/platform/platform_manager.py``). Why each override:

* ``communication_backend_name``: verl initialises ``cpu:gloo,cuda:nccl``
  (``utils/distributed.py:93``); NCCL cannot start without a GPU: ``gloo``.
* ``device_module`` (verl's ``get_torch_device()``): ``torch.cuda`` with one logical device
  (:class:`_OneLogicalCuda`): verl seeds megatron's RNG tracker only when
  ``get_torch_device().device_count() > 0`` (``workers/engine/megatron/utils.py:35``), and model
  construction fails without it ("cuda rng state model-parallel-rng is not added"); the tracker's
  own CUDA RNG calls are :mod:`r3bridge.testing.harness.cpu_shim`'s. Device bookkeeping calls
  (``synchronize``, ``empty_cache``, ``set_device``, ``mem_get_info``) are no-ops there.
* device calls (``set_device``, ``current_device``, ``synchronize``, ``empty_cache``,
  ``set_allocator_settings``, ``get_device_capability``): there is no CUDA device; Ray hands the
  worker a *logical* GPU (``+ray_kwargs.ray_init.num_gpus=1``) because verl's resource pools demand
  GPUs (``single_controller/ray/base.py:240``).

``device_name`` stays ``cuda`` and ``vendor_name`` ``nvidia``: verl's ``EngineRegistry`` then hands
out the engine the r3bridge adapter registers for ``(cuda, nvidia)``, as on a GPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry

NAME = "r3bridge_cpu"


class _OneLogicalCuda:
    """``torch.cuda`` as verl sees it on a CPU worker holding one logical GPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    def device_count(self) -> int:
        return 1

    def current_device(self) -> Any:
        return torch.cuda.current_device()     # "cpu" under r3bridge.testing.harness.cpu_shim

    def set_device(self, device: Any) -> None:
        return None

    def synchronize(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return 0, 0

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_reserved(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None


_DEVICE = _OneLogicalCuda()


@PlatformRegistry.register(platform=NAME)
class CPUGlooPlatform(PlatformCUDA):
    @property
    def device_module(self) -> Any:
        return _DEVICE

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_available(self) -> bool:
        return True

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> Any:
        # verl places tensors with .to(get_device_id()): r3bridge.testing.harness.cpu_shim makes
        # torch.cuda.current_device() answer "cpu" in the worker
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return 1

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def is_ipc_supported(self) -> bool:
        return False

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield


__all__ = ["NAME", "CPUGlooPlatform"]
