"""CPU shims that let megatron-core 0.16.1 run on a CPU-only torch build, for tests only.

Product code never imports this module: the shims change process-global state
(``torch.cuda.current_device``, megatron's RNG tracker, one name in a megatron module)
and only make sense inside a harness process that has no GPU at all.

Each shim is the smallest patch found by running the harness layouts on CPU; every one
records why it is needed. ``apply()`` is idempotent and returns the names it installed.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

_APPLIED: list[str] = []


def _shim_te_general_gemm() -> None:
    # moe_utils only defines ``te_general_gemm`` inside ``try: import transformer_engine``;
    # without TE the router's ``RouterGatingLinearFunction`` reads the undefined global and
    # raises ``NameError: name 'te_general_gemm' is not defined`` (moe_utils.py:1192).
    # ``None`` selects the plain ``torch.mm`` branch that already exists there.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_current_device() -> str:
    return "cpu"


def _shim_current_device() -> None:
    # megatron allocates many buffers with ``device=torch.cuda.current_device()`` (p2p shape
    # exchange, sequence-parallel gathers in tensor_parallel/mappings.py, router aux-loss
    # buffers, GPTModel/MTP buffers). On a CPU-only build that call raises "Torch not compiled
    # with CUDA enabled". Returning the string "cpu" makes every such allocation a CPU tensor;
    # an int would mean cuda:<int>, so it must be the string.
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


def _shim_rng_tracker() -> None:
    # tensor_parallel.random keeps named "cuda" RNG states (default / model-parallel /
    # expert-parallel) and swaps them in ``fork()`` and in ``CheckpointFunction`` (full
    # recompute). All of that calls torch.cuda.get_rng_state / set_rng_state, which fail on
    # a CPU build. Emulation: the "cuda generator" *is* the CPU default generator, so fork()
    # and checkpoint replay keep their GPU semantics (e.g. a TP-region dropout would draw from
    # the model-parallel stream and a recompute replays the same numbers).
    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_r3bridge_cpu", False):
        return

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """``CudaRNGStatesTracker`` whose ``add`` seeds the CPU generator (the base calls
        torch.cuda.get_rng_state / torch.cuda.manual_seed directly)."""

        _r3bridge_cpu = True

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state
    # initialize_rng_tracker() looks the class up by module global at call time, and
    # isinstance(tracker, CudaRNGStatesTracker) checks still hold for the subclass.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)

    # fork() warns "CPU RNG state changed within GPU RNG context" whenever code inside the
    # fork draws random numbers: with the cuda generator mapped onto the CPU one that is
    # expected, so that one message is filtered (on megatron's logger only).
    class _DropForkWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())


class _CpuTorchProxy(types.ModuleType):
    """Stand-in for ``torch`` inside one megatron module: everything is forwarded to torch,
    except factory calls with a literal ``device="cuda"``, which are placed on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _shim_schedules_cuda_literal() -> None:
    # pipeline_parallel/schedules.py allocates its token counter with a literal
    # ``torch.zeros([], dtype=torch.int, device="cuda")`` in all three schedules
    # (schedules.py:596, 983, 2138). Patching torch.zeros process-wide would be a far bigger
    # hammer, so only that module's ``torch`` name is replaced by a forwarding proxy.
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _CpuTorchProxy):
        schedules.torch = _CpuTorchProxy()  # type: ignore[assignment]


_SHIMS = (
    ("moe_utils.te_general_gemm=None", _shim_te_general_gemm),
    ("torch.cuda.current_device->'cpu'", _shim_current_device),
    ("tensor_parallel.random: cuda RNG -> CPU RNG", _shim_rng_tracker),
    ("schedules: device='cuda' literal -> cpu", _shim_schedules_cuda_literal),
)


def apply() -> list[str]:
    """Install every shim once (idempotent). Returns the names of the installed shims."""
    if torch.cuda.is_available():  # pragma: no cover - the harness is CPU only
        raise RuntimeError("r3bridge.testing.cpu_shim is for CPU-only processes")
    if not _APPLIED:
        for name, fn in _SHIMS:
            fn()
            _APPLIED.append(name)
    return list(_APPLIED)
