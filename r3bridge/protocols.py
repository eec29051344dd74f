"""The adapter protocol: what a framework adapter provides, and where it plugs in.

An adapter translates the framework's objects to and from :class:`~r3bridge.ReplayBatch` and calls
the Megatron driver (:mod:`r3bridge.megatron`, docs/driver-api.md) at the framework's
per-micro-batch hook. Everything else (validation, stitching, sharding, recording) is the core's.
Three parts; the first two are ``typing.Protocol`` classes (structural: nothing to inherit):

1. :class:`RolloutIngest` - generator side: the inference engine's per-call outputs of one rollout
   (vLLM ``routed_experts`` arrays, SGLang ``meta_info`` dicts, ...) -> one ``ReplayBatch``
   (``route_kind="rollout"``), multi-turn and resubmitted calls stitched first-seen
   (:func:`r3bridge.stitch`), never concatenated or overwritten.
2. :class:`BatchCodec` - trainer side: the framework's training batch <-> ``ReplayBatch``.
   ``to_replay_batch`` reads the routes the batch carries (rollout routes for R3, recorded ones
   for R2) for its samples *in batch order*; ``write_recorded`` puts R2's recorded routes back
   into the batch as per-sample data, so that any later re-partitioning of the batch into
   mini-/micro-batches (DP dispatch, dynamic batching, token balancing) carries each sample's
   routes with it. ``split`` is the framework's *own* partitioning, reporting
   which samples each part holds: the conformance suite checks that routes survive it.
3. the per-(chunk, micro-batch) install, right before the chunk's forward: the adapter hands
   each micro-batch's targets (:class:`r3bridge.megatron.MicroBatch`) to its
   :class:`r3bridge.session.AdapterSession`, which owns the set-up (config, announce, replayer,
   roles) and the pass (plan, driver pass, install, padding sequences, metrics, recorded routes).
   Frameworks that expose ``forward_step`` as a method override it and call
   ``ReplayPass.install(model, MicroBatch)``; frameworks whose ``forward_step`` is a closure inside a bigger method
   pass the targets to ``AdapterSession.run``, which installs from a forward
   pre-hook on each chunk and sees the trainer's real packing metadata (``packed_seq_params``).

The canonical trainer-side form every codec produces is :mod:`r3bridge.batch.canonical`'s.

:mod:`r3bridge.testing.kit.conformance` runs any adapter that implements these against canonical
rollouts and the CPU Megatron harness; ``adapters/_template`` is a commented skeleton.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from r3bridge.batch.schema import ReplayBatch

__all__ = ["RolloutIngest", "BatchCodec"]


@runtime_checkable
class RolloutIngest(Protocol):
    """Generator side of an adapter."""

    def routes_from_rollout(self, engine_outputs: Any) -> ReplayBatch:
        """One sample's (or a batch of samples') engine outputs -> ReplayBatch, route kind "rollout".
        Multi-turn / resubmitted calls are stitched first-seen; gaps or contradictions raise."""
        ...


@runtime_checkable
class BatchCodec(Protocol):
    """Trainer side of an adapter (``native`` is the framework's batch object)."""

    def to_replay_batch(self, native: Any, *, route_kind: str = "rollout") -> ReplayBatch:
        """The routes ``native`` carries, one sequence per sample, in batch order (canonical form).
        ``route_kind``: which routes to read, ``"rollout"`` or ``"recorded"`` (the keyword every
        adapter implements and the conformance kit passes)."""
        ...

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        """R2: return ``native`` with ``recorded`` (sample order = batch order) stored per sample."""
        ...

    def seq_lens(self, native: Any) -> list[int]:
        """Tokens the trainer sees per sample."""
        ...

    def split(self, native: Any, num_parts: int, order: Optional[list[int]] = None) -> list[tuple[Any, list[int]]]:
        """The framework's own partitioning into ``num_parts`` parts, after permuting the samples
        by ``order`` when given (what shuffling / dynamic sampling does): (part, sample indices
        into ``native``)."""
        ...
