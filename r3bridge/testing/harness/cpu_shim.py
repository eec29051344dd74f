"""CPU shims that let megatron-core 0.16.1 run on a CPU-only torch build, for tests only.

Product code never imports this module: the shims change process-global state
(a few ``torch.cuda`` functions, megatron's RNG tracker, names in three megatron modules)
and only make sense inside a harness process that has no GPU at all; ``dist.spawn`` applies
them in its worker processes only.

Each shim is the smallest patch found by running the harness layouts on CPU; every one
records why it is needed. ``apply()`` is idempotent and returns the names it installed.
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Iterator

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


def _cpu_synchronize(device: Any = None) -> None:
    return None


def _shim_synchronize() -> None:
    # The p2p layer calls ``torch.cuda.synchronize()`` after its batched shape exchange
    # (p2p_communication.py:242, reached with variable_seq_lengths, i.e. the alltoall
    # dispatcher under PP; also :398 if batch_p2p_comm were on) "to protect against race
    # condition when using batch_isend_irecv". On CPU every gloo request has been waited on
    # by then and there is no device stream: a no-op is exact.
    torch.cuda.synchronize = _cpu_synchronize  # type: ignore[assignment]


class _CpuEvent:
    """Stand-in for torch.cuda.Event: CPU work is synchronous, so every wait is a no-op."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def record(self, stream: Any = None) -> None:
        return None


class _CpuStream:
    """Stand-in for torch.cuda.Stream (see _shim_streams)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None


_DEFAULT_STREAM = _CpuStream()


def _shim_streams() -> None:
    # Only the alltoall token dispatcher needs this: its __init__ creates a class-level
    # ``torch.cuda.Stream()`` for device-to-host copies of the split sizes
    # (token_dispatcher.py:445, "torch.cuda.Stream requires CUDA support" on CPU) and its
    # ``_maybe_dtoh_and_synchronize`` uses current_stream / wait_stream / torch.cuda.stream /
    # record_event / Event.synchronize. Tensors are already on the CPU
    # (``maybe_move_tensor_to_cpu`` is a no-op for non-CUDA tensors), so inert objects keep
    # the exact semantics.
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment, misc]
    torch.cuda.Event = _CpuEvent  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]


def _shim_alltoall_splits() -> None:
    # The alltoall dispatcher keeps its split sizes as tensors and relies on
    # ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` to turn them into numpy arrays, but that
    # helper only converts CUDA tensors. On CPU they stay tensors and gloo's
    # ``all_to_all_single`` rejects them ("incompatible function arguments"). The dispatcher
    # module's reference is replaced by one that also converts CPU tensors when asked to.
    from megatron.core.transformer.moe import token_dispatcher

    orig = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(orig, "_r3bridge_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._r3bridge_cpu = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


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


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


class _CpuTorchProxy(types.ModuleType):
    """Stand-in for ``torch`` inside one megatron module: every attribute is forwarded to
    torch, except tensor factories called with a literal ``device="cuda"``, which are placed
    on the CPU instead."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:  # only called for names not set above
        return getattr(torch, name)

    @staticmethod
    def _cpu_factory(factory: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> torch.Tensor:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make


def _proxy_torch_in(module: types.ModuleType) -> None:
    if not isinstance(module.torch, _CpuTorchProxy):
        module.torch = _CpuTorchProxy()  # type: ignore[attr-defined]


def _shim_cuda_literals() -> None:
    # A few megatron modules allocate with a literal ``device="cuda"`` instead of
    # ``torch.cuda.current_device()``; patching torch.zeros/ones process-wide would be a far
    # bigger hammer, so only those modules' ``torch`` name is replaced by a forwarding proxy:
    # * pipeline_parallel/schedules.py: ``total_num_tokens = torch.zeros([], ..., device="cuda")``
    #   in all three schedules (schedules.py:596, 983, 2138);
    # * transformer/utils.py: ``get_default_causal_mask`` (``torch.ones(sq, sq, device="cuda")``),
    #   used by local DotProductAttention's torch softmax whenever attention_mask is None. The
    #   harness forward step always passes a mask; this is for callers (demo, adapters) that
    #   call a harness model with attention_mask=None.
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    _proxy_torch_in(schedules)
    _proxy_torch_in(transformer_utils)


@contextlib.contextmanager
def tensor_cuda_is_identity() -> Iterator[None]:
    """Make ``Tensor.cuda()`` return the CPU tensor itself, only inside this block.

    Needed around model construction only: with MTP and PP > 1, megatron's
    ``LanguageModule.setup_embeddings_and_output_layer`` does
    ``weight.data = weight.data.cuda()`` before all-reducing the MTP stage's copy of the word
    embedding (language_module.py:244). Not installed process-wide so any other ``.cuda()``
    still fails loudly. A no-op when CUDA is available (GPU runs of the harness models).
    """
    if torch.cuda.is_available():
        yield
        return
    orig = torch.Tensor.cuda

    def _identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = _identity  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = orig  # type: ignore[method-assign]


_SHIMS = (
    ("moe_utils.te_general_gemm=None", _shim_te_general_gemm),
    ("torch.cuda.current_device->'cpu'", _shim_current_device),
    ("torch.cuda.synchronize->no-op", _shim_synchronize),
    ("torch.cuda.Stream/Event/current_stream/stream -> inert CPU objects", _shim_streams),
    ("alltoall dispatcher: CPU split sizes -> numpy", _shim_alltoall_splits),
    ("tensor_parallel.random: cuda RNG -> CPU RNG", _shim_rng_tracker),
    ("schedules/transformer.utils: device='cuda' literals -> cpu", _shim_cuda_literals),
)


def apply() -> list[str]:
    """Install every shim once (idempotent). Returns the names of the installed shims."""
    if torch.cuda.is_available():  # pragma: no cover - the harness is CPU only
        raise RuntimeError("r3bridge.testing.harness.cpu_shim is for CPU-only processes")
    if not _APPLIED:
        for name, fn in _SHIMS:
            fn()
            _APPLIED.append(name)
    return list(_APPLIED)
