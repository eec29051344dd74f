"""Run a function on N CPU ranks (gloo) with megatron model parallel state initialised.

``spawn`` always starts fresh processes, even for ``world_size=1``: the CPU shims patch
process-global state (``torch.cuda.current_device``, megatron's RNG tracker), which must
never leak into the pytest process or into product code. ``spawn_layouts`` runs several
layouts of the same world size in one set of processes (megatron's parallel state is torn
down and rebuilt between layouts), which saves the ~5 s per process start of importing
megatron on a small CI box.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import queue as queue_mod
import re
import socket
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class Layout:
    """A parallel layout. dp is implied: world_size / (tp * cp * pp)."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def dp(self, world_size: int) -> int:
        model = self.tp * self.cp * self.pp
        if world_size % model:
            raise ValueError(f"world_size {world_size} not divisible by tp*cp*pp={model}")
        return world_size // model


@dataclass(frozen=True)
class RankContext:
    """What a rank function gets: sizes and this rank's coordinates in every group."""

    rank: int
    world_size: int
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    ep: int
    etp: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    ep_rank: int
    etp_rank: int
    dp_rank: int  # data-parallel rank without CP (samples differ across dp ranks)
    seed: int
    layout_index: int = 0  # position of this layout in spawn_layouts' list (per-layout test cases)

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.vpp, self.cp, self.ep, self.etp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


class RankError(RuntimeError):
    """A rank raised; carries the rank, the layout and the remote traceback text."""

    def __init__(self, rank: int, layout: Layout, remote_traceback: str):
        self.rank = rank
        self.layout = layout
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed under {layout}:\n{remote_traceback}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_layout(layout: Layout, rank: int, world_size: int, seed: int) -> RankContext:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dp = layout.dp(world_size)  # validates divisibility
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    # The data-parallel seed is the same on every rank (megatron semantics), the TP / expert
    # streams are offset per rank inside model_parallel_cuda_manual_seed (CPU-mapped by the shim).
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return RankContext(
        rank=rank,
        world_size=world_size,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.etp,
        dp=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
        seed=seed,
    )


def _start_rank(rank: int, world_size: int, port: int, timeout: float, backend: str) -> None:
    """This process becomes ``rank`` of the process group: CPU shims (gloo) or its GPU (nccl)."""
    # Two CI cores shared by several ranks: one intra-op thread per rank avoids thrashing.
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")
    # torch warns that megatron's all_gather_into_tensor / reduce_scatter_tensor are deprecated.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        # one GPU per rank, no CPU shim; only the TE-less router name megatron 0.16.1 needs
        from megatron.core.transformer.moe import moe_utils

        torch.cuda.set_device(rank)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    else:
        from r3bridge.testing.harness import cpu_shim

        cpu_shim.apply()
    torch.distributed.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _worker(
    rank: int,
    world_size: int,
    port: int,
    layouts: Sequence[Layout],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    timeout: float,
    seed: int,
    backend: str = "gloo",
) -> None:
    idx = -1
    try:
        _start_rank(rank, world_size, port, timeout, backend)
        from megatron.core import parallel_state as ps

        for idx, layout in enumerate(layouts):
            ctx = dataclasses.replace(_init_layout(layout, rank, world_size, seed), layout_index=idx)
            try:
                out = fn(ctx, *args)
            finally:
                ps.destroy_model_parallel()
            # Pickled here by value: torch's queue reducer would share tensor storage through
            # file descriptors that die with this process.
            results.put((rank, idx, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, idx, "err", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # pragma: no cover - teardown after a failure
                pass


# Errors a rank gets only because *another* rank died (its gloo peer went away).
_SECONDARY = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|peer closed")


def _rank_error(layouts: Sequence[Layout], first: tuple[int, int, str], results: Any) -> RankError:
    """Collect other ranks' errors for a moment and raise the root cause, not the fallout."""
    errors = [first]
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        try:
            rank, idx, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            continue
        if status == "err":
            errors.append((rank, idx, payload))
    primary = next((e for e in errors if not _SECONDARY.search(e[2])), errors[0])
    rank, idx, text = primary
    others = [
        f"  rank {r}: {t.strip().splitlines()[-1] if t.strip() else '?'}"
        for r, _, t in errors
        if (r, t) != (rank, text)
    ]
    if others:
        text += "\nother ranks failed too:\n" + "\n".join(others)
    return RankError(rank, layouts[idx] if idx >= 0 else Layout(), text)


def spawn_layouts(
    fn: Callable[..., Any],
    *,
    world_size: int,
    layouts: Sequence[Layout],
    args: tuple[Any, ...] = (),
    timeout: float = 300.0,
    seed: int = 1234,
    backend: str = "gloo",
) -> list[list[Any]]:
    """Run ``fn(ctx, *args)`` under each layout in turn in one set of ``world_size`` processes.

    ``backend="nccl"``: one GPU per rank (``cuda:rank``), no CPU shim.

    Returns ``results[layout_index][rank]``. ``fn`` must be importable (module level) and its
    return value picklable. The first failing rank's traceback is raised as :class:`RankError`
    (the other ranks are killed); ``TimeoutError`` after ``timeout`` seconds in total.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    for lay in layouts:
        lay.dp(world_size)
    try:
        return _spawn_once(fn, world_size, layouts, args, timeout, seed, backend)
    except RankError as e:
        # free_port() can race with another process on a shared box: retry once on a new port.
        if "Address already in use" not in e.remote_traceback:
            raise
        return _spawn_once(fn, world_size, layouts, args, timeout, seed, backend)


def _spawn_once(
    fn: Callable[..., Any],
    world_size: int,
    layouts: Sequence[Layout],
    args: tuple[Any, ...],
    timeout: float,
    seed: int,
    backend: str = "gloo",
) -> list[list[Any]]:
    mp = torch.multiprocessing.get_context("spawn")
    results = mp.Queue()
    port = free_port()
    procs = [
        mp.Process(
            target=_worker,
            args=(r, world_size, port, list(layouts), fn, args, results, timeout, seed, backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: list[list[Any]] = [[None] * world_size for _ in layouts]
    pending = world_size * len(layouts)
    deadline = time.monotonic() + timeout
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"spawn: {pending} rank result(s) missing after {timeout:.0f}s "
                    f"(world_size={world_size}, layouts={list(layouts)})"
                )
            try:
                rank, idx, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    # Give a crashing rank a moment to flush its traceback into the queue.
                    try:
                        rank, idx, status, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise RuntimeError(
                            f"rank(s) {dead} died without reporting "
                            f"(exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
                else:
                    continue
            if status == "err":
                raise _rank_error(layouts, (rank, idx, payload), results)
            out[idx][rank] = pickle.loads(payload)
            pending -= 1
        for p in procs:  # teardown (destroy_process_group, interpreter exit); killed below if slow
            p.join(timeout=min(10.0, max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return out


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    etp: int = 1,
    args: tuple[Any, ...] = (),
    timeout: float = 300.0,
    seed: int = 1234,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks (gloo CPU, or nccl GPUs) under one layout.

    Returns the per-rank return values in rank order. See :func:`spawn_layouts`.
    """
    layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)
    return spawn_layouts(
        fn, world_size=world_size, layouts=[layout], args=args, timeout=timeout, seed=seed,
        backend=backend,
    )[0]


def run_as_only_rank(fn: Callable[..., Any], *, args: tuple[Any, ...] = (), backend: str = "gloo",
                     seed: int = 1234) -> Any:
    """``fn(ctx, *args)`` as the one rank of a one-rank world, in *this* process (megatron
    parallel state set up and torn down around it); returns what ``fn`` returns.

    Only for a process started to be that rank (a script's or a job's own process): with gloo the
    CPU shims patch process-global state for the rest of the process's life, and it keeps one
    intra-op thread. :func:`spawn` is the same in a fresh child process, for everyone else."""
    from megatron.core import parallel_state as ps

    _start_rank(0, 1, free_port(), 24 * 3600.0, backend)
    try:
        ctx = _init_layout(Layout(), 0, 1, seed)
        try:
            return fn(ctx, *args)
        finally:
            ps.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()


__all__ = ["Layout", "RankContext", "RankError", "free_port", "run_as_only_rank", "spawn", "spawn_layouts"]
