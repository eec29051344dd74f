"""What verl 0.9.1's Megatron engine and workers need on a CPU-only gloo rank, for tests only.

Used by :mod:`testlab.verl_job` inside processes started by ``dist.spawn`` (after
:func:`r3bridge.testing.harness.cpu_shim.apply`). Each shim exists only because there is no CUDA device
or no Transformer Engine here, and none changes what verl does with batches, micro-batches or
schedules (docs/testing-harness.md lists them):

* :func:`apply` (process-wide, idempotent): megatron's mixed-precision optimizer allocates
  ``found_inf`` / ``_scale_one`` with a literal ``device='cuda'`` (``optimizer.py:473-485``), as
  do the grad-norm buffers (``clip_grads.py:103``, the local ``multi_tensor_l2norm`` in
  ``megatron/core/utils.py:1207``) and the loss scaler (``grad_scaler.py``);
  those modules' ``torch`` name is the CPU-placing proxy ``cpu_shim`` already uses for
  ``schedules.py``.
* :func:`apply`: verl's platform falls back to ``nvidia`` on a machine without accelerator, so
  ``get_device_name()`` is ``"cuda"``, and a few verl modules allocate small bookkeeping tensors
  with ``device=get_device_name()``: the dynamic-batch micro-batch count and its all-reduce
  (``utils/seqlen_balancing.py:404,430,457``), the worker's loss sum (``engine_workers.py:195``),
  ``allgather_dict_into_dict``'s counts (``utils/torch_functional.py:938``). Those modules'
  ``torch`` name becomes ``cpu_shim``'s CPU-placing proxy (factories only; no other call changes).
* :func:`apply`: verl's platform falls back to ``nvidia`` without an accelerator, so
  ``get_torch_device()`` is ``torch.cuda``; its memory logger (``log_gpu_memory_usage``, called
  unconditionally by the engine's ``initialize``) reads ``torch.cuda.mem_get_info()``, which
  raises "Expected a cuda device, but got: cpu". It reports ``(0, 0)``: no device memory. The
  worker's MFU metric asks ``torch.cuda.get_device_name()`` for the peak FLOPs table
  (``utils/flops_counter.py:80``): ``"CPU"``, the name verl itself uses without CUDA.
* :func:`apply`: ``Tensor.type()`` without argument names the CUDA type of a CPU tensor
  (``torch.cuda.BFloat16Tensor``). megatron's ``Float16OptimizerWithFloat16Params`` and
  ``DistributedOptimizer`` accept bf16 / fp16 params only if ``param.type()`` names a
  ``torch.cuda.*Tensor`` (``optimizer.py:671``, ``distrib_optimizer.py:431``, else ``TypeError``)
  and gradient clipping asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``
  (``clip_grads.py:167``); verl's ``McoreEngineConfig`` allows only bf16 / fp16 params. Only
  ``type()``'s string changes: the tensors stay CPU tensors.
* :func:`build_shims` (around a worker's ``reset()`` / ``init_model()``): :func:`apply` plus :func:`testlab.mbridge_spec.te_free_bridges`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

_APPLIED: list[str] = []


def _no_device_memory(device: Any = None) -> tuple[int, int]:
    return 0, 0


def _cpu_device_name(device: Any = None) -> str:
    return "CPU"


def apply() -> list[str]:
    """Install the process-wide part (idempotent); returns the shim names."""
    if torch.cuda.is_available():  # pragma: no cover - CPU harness only
        raise RuntimeError("testlab.verl_cpu is for CPU-only processes")
    if not _APPLIED:
        from megatron.core import utils as mcore_utils
        from megatron.core.optimizer import clip_grads, grad_scaler
        from megatron.core.optimizer import optimizer as mcore_optimizer

        from r3bridge.testing.harness.cpu_shim import _proxy_torch_in

        for mod in (mcore_optimizer, clip_grads, grad_scaler, mcore_utils):
            _proxy_torch_in(mod)
        import verl.utils.seqlen_balancing as seqlen_balancing
        import verl.utils.torch_functional as torch_functional
        import verl.workers.engine_workers as engine_workers

        for mod in (seqlen_balancing, torch_functional, engine_workers):
            _proxy_torch_in(mod)
        _APPLIED.append("verl seqlen_balancing / torch_functional / engine_workers: device='cuda' -> cpu")
        _APPLIED.append("megatron optimizer / clip_grads / grad_scaler / utils: device='cuda' literals -> cpu")
        torch.cuda.mem_get_info = _no_device_memory  # type: ignore[assignment]
        torch.cuda.get_device_name = _cpu_device_name  # type: ignore[assignment]
        _APPLIED.append("torch.cuda.mem_get_info -> (0, 0); torch.cuda.get_device_name -> 'CPU'")
        _shim_tensor_type()
        _APPLIED.append("Tensor.type() of a CPU tensor -> 'torch.cuda.*Tensor'")
    return list(_APPLIED)


def _shim_tensor_type() -> None:
    orig = torch.Tensor.type
    if getattr(orig, "_r3bridge_cpu", False):
        return

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str) and out.startswith("torch.") \
                and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out

    _type._r3bridge_cpu = True  # type: ignore[attr-defined]
    torch.Tensor.type = _type  # type: ignore[method-assign, assignment]


@contextlib.contextmanager
def build_shims(**bridge_kwargs: Any) -> Iterator[None]:
    """Around a verl worker's ``reset()`` / ``init_model()``: TE-free mbridge models, CPU optimizer."""
    from testlab.mbridge_spec import te_free_bridges

    apply()
    with te_free_bridges(**bridge_kwargs):
        yield


__all__ = ["apply", "build_shims"]
