"""The runner contract of conformance checks 4-5, and the helpers a runner needs.

A :class:`MegatronRunner` is the part of an adapter's test that knows the framework: it builds
the framework's engine around the harness model chunks, cuts the framework's own micro-batches,
runs one framework pass and reports what happened. Checks 4-5
(:func:`r3bridge.testing.kit.conformance.megatron_r3_check` / ``megatron_r2_check``) call it inside
CPU ranks started by :func:`r3bridge.testing.harness.dist.spawn_layouts`; it must therefore be built
by a picklable factory (a class, or a ``functools.partial`` of one) from the rollout.

How harness chunks reach the framework's engine: the chunks (one real megatron-core ``GPTModel``
per virtual pipeline stage of the rank, :func:`r3bridge.testing.harness.models.build_model_chunks`)
take the place of the model the framework would build, and the framework's own code runs around
them: its micro-batching, its packing, its call of Megatron's schedule, the adapter's hook.
Stand in only for what cannot exist on CPU (Transformer Engine, the framework's model builder
or bridge) and keep the stand-in to the model-running body of its ``forward_step``: feed the
harness forward step (:func:`r3bridge.testing.harness.schedule.make_forward_step` with ``thd=True,
collect_logits=True``) the packing the framework made (:func:`pack_thd` for a framework that
pads each sequence to an alignment), or call the chunk with the framework's own arguments.

Helpers: :func:`pack_thd` (THD packing with per-sequence alignment padding),
:func:`unpack_rows` (a packed last-stage output back per sequence), :func:`record_packing` (the
``packing`` entries, read from the ``packed_seq_params`` the framework passes to the model).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.testing.harness.data import PackedBatch, align_for
from r3bridge.testing.kit.rollouts import CanonicalRollout

__all__ = ["MegatronRunner", "pack_thd", "unpack_rows", "record_packing", "align_for"]


class MegatronRunner(Protocol):
    """What an adapter's test supplies for checks 4-5: one framework pass on harness chunks.

    The checks call, in this order: :meth:`attach`, :meth:`micro_batches`, :meth:`run` (check 4:
    once, R3 compute_log_prob); :meth:`attach`, :meth:`micro_batches` (``key=None``),
    :meth:`run` (R2 compute_log_prob, recording), :meth:`write_recorded`, :meth:`micro_batches`
    (``key="recorded"``, re-grouped), :meth:`run` (update, replaying the recorded routes). A fresh
    runner is built for each check.
    """

    def attach(self, ctx: Any, chunks: list, mode: str) -> Any:
        """Build the framework's engine (or actor) around ``chunks`` with ``replay_mode=mode``
        (``"R3"`` or ``"R2"``), attached by the adapter's own attach code, and return it.

        The returned object may carry ``.replayer``: the adapter's
        :class:`r3bridge.megatron.Replayer`; check 4 then takes the parallel layout from
        ``replayer.layout`` (the layout the adapter really attached with), else from the chunks'
        config (``ParallelLayout.from_megatron``).
        """
        ...

    def micro_batches(self, rollout: CanonicalRollout, groups: Sequence[Sequence[int]], *,
                      key: Optional[str]) -> Any:
        """The framework's micro-batches holding rollout samples ``groups[m]``, built by the
        framework's own code. ``key``: ``"rollout"`` (the engine's routes, R3), ``"recorded"``
        (the routes :meth:`write_recorded` kept, R2 replay) or ``None`` (no routes: the R2
        recording pass). Any object :meth:`run` accepts."""
        ...

    def run(self, obj: Any, micro_batches: Any, *, phase: str) -> dict:
        """One framework pass (``phase``: ``"compute_log_prob"`` or ``"update"``) of ``obj``
        over ``micro_batches``, through the framework's own phase method of that name (its
        compute_log_prob / update, the adapter's overrides in front: the R2 sample index, the
        write-back, the update's re-partitioning), not its schedule call directly: what the
        override does is what the checks see (``adapters/_template/conformance_tests.py`` shows
        how). Returns a dict:

        * ``"logprobs"``: on the last pipeline stage, one tensor per sample in the order of
          ``[i for g in groups for i in g]``: the last stage's per-token output rows of that
          sample (logits of the harness model, or the framework's log-probs: anything the model
          computes deterministically from the routes; check 5 compares record and replay). An
          empty list on other stages.
        * ``"metrics"``: the driver's metrics of the pass (``PhaseResult.metrics``), every rank.
        * ``"recorded"``: after an R2 recording pass, the recorded ``ReplayBatch`` in rollout
          sample order (as the framework hands it on), else ``None``.
        * ``"packing"``: one dict per micro-batch in the order chunk 0 ran them:
          ``seq_lens`` (tokens per packed sequence; the framework's padding "sequences" after
          the real ones), ``format`` (``"thd"`` / ``"bshd"``), ``cu_seqlens_padded`` (THD: the
          ``packed_seq_params.cu_seqlens_q_padded`` the framework passed to the model, never
          re-derived), ``seq_length`` (BSHD), and ``samples`` (optional: the rollout sample of
          each real sequence, for a framework that re-partitions micro-batches itself).
          :func:`record_packing` records the THD entries.
        * ``"framework_metrics"`` (optional): what the adapter handed to the framework's logger.
        """
        ...

    def write_recorded(self, rollout: CanonicalRollout, recorded: ReplayBatch) -> None:
        """Keep ``recorded`` (rollout sample order) the way the framework keeps R2 routes, for
        the next ``micro_batches(..., key="recorded")``; nothing to do when the adapter's own
        compute_log_prob (run by :meth:`run`) wrote it back, as in a real job."""
        ...


def pack_thd(token_lists: Sequence[Sequence[int]], *, vocab_size: int, align: int) -> PackedBatch:
    """THD packing of a micro-batch, each sequence padded to a multiple of ``align``
    (:func:`align_for` ``(tp, cp)``: what SP and CP zigzag need), as the harness forward step
    takes it. Token ids are folded into ``1..vocab_size-1``; labels are the next token."""
    lens = [len(t) for t in token_lists]
    padded = [-(-n // align) * align for n in lens]
    total = sum(padded)
    ids, labels = torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64)
    mask, pos = torch.zeros(total), torch.zeros(total, dtype=torch.int64)
    offset = 0
    for tokens, padded_len in zip(token_lists, padded):
        folded = torch.tensor(list(tokens), dtype=torch.int64) % (vocab_size - 1) + 1
        ids[offset:offset + len(folded)] = folded
        labels[offset:offset + len(folded) - 1] = folded[1:]
        mask[offset:offset + len(folded) - 1] = 1.0
        pos[offset:offset + padded_len] = torch.arange(padded_len)
        offset += padded_len
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    cu_padded = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu_padded[1:] = torch.cumsum(torch.tensor(padded, dtype=torch.int64), 0)
    return PackedBatch(lens, padded, ids, labels, mask, pos, cu, cu_padded)


def unpack_rows(output: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """A packed last-stage output ``[T, ...]`` (e.g. the harness's collected logits) back per
    sequence: each sequence's real tokens, without its alignment padding."""
    return [output[int(offset):int(offset) + n] for offset, n in zip(packed.cu_seqlens_padded, packed.seq_lens)]


@contextlib.contextmanager
def record_packing(chunk: torch.nn.Module) -> Iterator[list[dict]]:
    """Record, for every forward of ``chunk`` (a runner passes chunk 0), the THD ``packing``
    entry :meth:`MegatronRunner.run` reports, from the ``packed_seq_params`` the framework
    passes: real lengths from ``cu_seqlens_q``, padded offsets ``cu_seqlens_q_padded``."""
    entries: list[dict] = []

    def note(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        params = kwargs.get("packed_seq_params")
        if params is None:
            raise ValueError("record_packing: the forward got no packed_seq_params (not a THD micro-batch)")
        entries.append(dict(seq_lens=params.cu_seqlens_q.diff().tolist(), format="thd",
                            cu_seqlens_padded=params.cu_seqlens_q_padded.cpu()))
    handle = chunk.register_forward_pre_hook(note, with_kwargs=True)
    try:
        yield entries
    finally:
        handle.remove()
