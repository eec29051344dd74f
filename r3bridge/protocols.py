"""The adapter protocol: what a framework adapter provides, and where it plugs in.

An adapter translates the framework's objects to and from :class:`~r3bridge.ReplayBatch` and calls
the Megatron driver (:mod:`r3bridge.megatron`, docs/driver-api.md) at the framework's
per-micro-batch hook. Everything else (validation, stitching, sharding, recording) is the core's.
Three parts, each a ``typing.Protocol`` (structural: nothing to inherit):

1. :class:`RolloutIngest` - generator side: the inference engine's per-call outputs of one rollout
   (vLLM ``routed_experts`` arrays, SGLang ``meta_info`` dicts, ...) -> one ``ReplayBatch``
   (``source="rollout"``), multi-turn and resubmitted calls stitched first-seen
   (:func:`r3bridge.stitch`), never concatenated or overwritten.
2. :class:`BatchCodec` - trainer side: the framework's training batch <-> ``ReplayBatch``.
   ``to_replay_batch`` reads the routes the batch carries (rollout routes for R3, recorded ones
   for R2) for its samples *in batch order*; ``write_recorded`` puts R2's recorded routes back
   into the batch as per-sample data, so that any later re-partitioning of the batch into
   mini-/micro-batches (DP dispatch, dynamic batching, token balancing) carries each sample's
   routes with it (field-notes 8.11). ``split`` is the framework's *own* partitioning, reporting
   which samples each part holds: the conformance suite checks that routes survive it.
3. :class:`MicroBatchHook` - the per-(chunk, micro-batch) call into the driver:
   ``step.install(model, routes, seq_lens, cu_seqlens_padded=...)`` right before the chunk's
   forward. Frameworks that expose ``forward_step`` as a method (verl) override it; frameworks
   whose ``forward_step`` is a closure inside a bigger method (SkyRL, AReaL) wrap the method and
   install from a forward pre-hook on each chunk (:func:`install_before_forward`), which also
   sees the trainer's real packing metadata (``packed_seq_params``).

Canonical trainer-side form (so that every framework produces byte-identical ReplayBatches for
the same rollout): one sequence per sample, ``start_rows = 0``, one row per token the trainer
sees, rows the engine never routed ``valid = False``; the final token's row is dropped when it has
no route (the last sampled token is never fed forward), so a complete single-call rollout of
``N`` tokens has ``N - 1`` rows, like vLLM's own output. ``source`` is ``"rollout"`` for engine
routes and ``"recorded"`` for R2 (the driver checks it against the phase).

:mod:`r3bridge.testing.conformance` runs any adapter that implements these against canonical
rollouts and the CPU Megatron harness; ``adapters/_template`` is a commented skeleton.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import contextlib

import torch

from r3bridge.errors import CoverageError, ReplayStateError
from r3bridge.schema import ReplayBatch

__all__ = ["RolloutIngest", "BatchCodec", "MicroBatchHook", "MicroBatchTargets",
           "install_before_forward", "drop_final_invalid_rows", "canonical_form"]


@runtime_checkable
class RolloutIngest(Protocol):
    """Generator side of an adapter."""

    def routes_from_rollout(self, engine_outputs: Any) -> ReplayBatch:
        """One sample's (or a batch of samples') engine outputs -> ReplayBatch, source "rollout".
        Multi-turn / resubmitted calls are stitched first-seen; gaps or contradictions raise."""
        ...


@runtime_checkable
class BatchCodec(Protocol):
    """Trainer side of an adapter (``native`` is the framework's batch object)."""

    def to_replay_batch(self, native: Any, *, source: str = "rollout") -> ReplayBatch:
        """The routes ``native`` carries, one sequence per sample, in batch order (canonical form)."""
        ...

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        """R2: return ``native`` with ``recorded`` (sample order = batch order) stored per sample."""
        ...

    def seq_lens(self, native: Any) -> list[int]:
        """Tokens the trainer sees per sample."""
        ...

    def split(self, native: Any, num_parts: int) -> list[tuple[Any, list[int]]]:
        """The framework's own partitioning into ``num_parts`` parts: (part, sample indices)."""
        ...


class MicroBatchTargets(dict):
    """Keyword arguments of one ``ReplayStep.install`` call, minus ``model``:
    ``routes``, ``seq_lens``, optional ``cu_seqlens_padded``, ``format``, ``seq_length``,
    ``sample_ids``."""


@runtime_checkable
class MicroBatchHook(Protocol):
    """Per-(chunk, micro-batch) part of an adapter."""

    def targets(self, chunk: int, micro_batch: int, args: tuple, kwargs: dict) -> MicroBatchTargets:
        """What to install for micro-batch ``micro_batch`` of chunk ``chunk``; ``args`` / ``kwargs``
        are the chunk's forward arguments (``packed_seq_params`` lives in ``kwargs``)."""
        ...


@contextlib.contextmanager
def install_before_forward(step: Any, chunks: Sequence[torch.nn.Module], hook: MicroBatchHook | Callable,
                           num_micro_batches: Optional[int] = None) -> Iterator[list[int]]:
    """Call ``step.install`` right before every forward of every chunk, for frameworks whose
    ``forward_step`` is a closure (SkyRL ``MegatronModelWrapper``, AReaL ``MegatronEngine``).

    Megatron's schedules (no pipelining, 1F1B, interleaved VPP) run each chunk's forwards in
    micro-batch order 0..M-1, once each, so the k-th forward of chunk c is micro-batch k. The hook
    is a *prepended* ``forward_pre_hook`` (public torch API, nothing is patched), so it runs before
    the driver's own pre-hook, which then refuses a forward without an install. Yields the per-chunk
    forward counts; raises ``ReplayStateError`` on more forwards than ``num_micro_batches``.
    """
    get = hook.targets if hasattr(hook, "targets") else hook
    counts = [0] * len(chunks)
    handles = []

    def make(c: int):
        def pre(module, args, kwargs):
            k = counts[c]
            if num_micro_batches is not None and k >= num_micro_batches:
                raise ReplayStateError(f"chunk {c}: forward #{k + 1} but the schedule has only "
                                       f"{num_micro_batches} micro-batches")
            t = dict(get(c, k, args, kwargs))
            routes = t.pop("routes", None)
            seq_lens = t.pop("seq_lens")
            step.install(module, routes, seq_lens, **t)
            counts[c] = k + 1
            return None
        return pre

    try:
        for c, chunk in enumerate(chunks):
            handles.append(chunk.register_forward_pre_hook(make(c), prepend=True, with_kwargs=True))
        yield counts
    finally:
        for h in handles:
            h.remove()


def drop_final_invalid_rows(rb: ReplayBatch) -> ReplayBatch:
    """Canonical trainer-side form: drop each sequence's last row when it has no route.

    Only sequences starting at row 0 whose rows cover every trainer token should be passed (the
    padded / jagged trainer formats); the last sampled token is never fed to the engine."""
    if rb.num_seqs == 0 or rb.total_rows == 0:
        return rb
    rows = torch.tensor(rb.rows_per_seq, dtype=torch.int64)
    ends = rb.offsets[1:] - 1
    has = rows > 0
    drop = torch.zeros(rb.num_seqs, dtype=torch.bool)
    drop[has] = ~rb.valid.cpu()[ends[has]]
    if not bool(drop.any()):
        return rb
    keep = torch.ones(rb.total_rows, dtype=torch.bool)
    keep[ends[drop]] = False
    keep_d = keep.to(rb.routes.device)
    return ReplayBatch.from_packed(rb.routes[keep_d], (rows - drop.long()).tolist(), num_experts=rb.num_experts,
                                   layer_ids=rb.layer_ids, start_rows=rb.start_rows, valid=rb.valid[keep_d],
                                   source=rb.source, policy_versions=rb.policy_versions)


def canonical_form(rb: ReplayBatch, seq_lens: Sequence[int]) -> ReplayBatch:
    """Extend each sequence (start 0) with invalid rows up to its token count, then drop a final
    row without a route: the canonical trainer-side form shared by every adapter."""
    if any(s != 0 for s in rb.start_rows):
        raise CoverageError("canonical form needs routes starting at token 0")
    lens = [int(n) for n in seq_lens]
    if len(lens) != rb.num_seqs:
        raise CoverageError(f"{len(lens)} seq_lens for {rb.num_seqs} sequences")
    seqs, valids = [], []
    for i, n in enumerate(lens):
        r, v = rb.sequence(i)
        if r.shape[0] > n:
            raise CoverageError(f"sequence {i}: {r.shape[0]} route rows for {n} tokens")
        pad = n - r.shape[0]
        seqs.append(torch.cat([r, torch.zeros((pad,) + tuple(r.shape[1:]), dtype=r.dtype)]))
        valids.append(torch.cat([v, torch.zeros(pad, dtype=torch.bool)]))
    full = ReplayBatch.from_packed(torch.cat(seqs) if seqs else rb.routes, lens, num_experts=rb.num_experts,
                                   layer_ids=rb.layer_ids, valid=torch.cat(valids) if valids else rb.valid,
                                   source=rb.source)
    return drop_final_invalid_rows(full)
