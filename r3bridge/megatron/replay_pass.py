"""The driver's state for one pass (one ``forward_backward_func`` call): targets keyed by
(chunk, micro-batch), consumed exactly once in the forward and once in the recompute.

One :class:`ReplayPass` is the whole pass between an adapter and the routers (megatron-core's
model: one ``RouterReplay`` beside each router): a phase's pass
(:meth:`r3bridge.session.PhaseRunner.run` yields it) installs the adapter's :class:`MicroBatch`
records, whose sample ids, padding sequences and VPP repeats it keeps per micro-batch; a pass
opened on the :class:`~r3bridge.megatron.Replayer` directly installs routes and lengths.

Why keys and not megatron's per-router FIFO: a FIFO pairs forward and recompute correctly only if
every (chunk, micro-batch) pushes exactly once to exactly its own routers and every micro-batch is
recomputed alike; a forward-only pass or a skipped recompute leaves entries that the next pass
consumes (field notes 8.2). Here:

* the chunk's forward is bracketed by module hooks, so a router call *inside* it belongs to the
  micro-batch installed last for that chunk;
* every router call in the forward of a training pass may come back once as a recompute: a
  reentrant checkpoint's first pass (grad disabled; megatron's ``recompute_granularity`` /
  ``recompute_modules``) keeps its targets for it, a grad-enabled call (no checkpoint, or a
  non-reentrant one, which cannot be told apart there) only queues the key, and its recompute, if
  one comes, re-derives that layer's target from the micro-batch's routes;
* a router call *outside* any forward is a recompute and takes the oldest queued key of its layer
  (backward runs in forward order per chunk). That assumption is checked, not trusted: each queued
  key carries a fingerprint of the router's scores (a few rows' sums) and the recompute's must
  match, else the pass ends with a ReplayStateError naming layer, chunk and micro-batch. The
  comparison stays on the device (one host sync at the end of the pass, not one per call);
* a queued key never recomputed (a layer without checkpointing, or a frozen one whose backward
  never runs) is dropped at the end of the pass: nothing was replayed from it;
* every other use is checked, and the pass refuses to end with an installed micro-batch that never
  ran forward; all state is dropped in ``close`` whatever happened.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import numpy as np
import torch

from r3bridge.batch.provenance import ProvenanceCount
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.config import Action, Phase, PhasePlan
from r3bridge.errors import ConfigError, CoverageError, ReplayStateError, RouteWeightsError
from r3bridge.megatron import stats_mask
from r3bridge.megatron.combine_weights import CombineWeights
from r3bridge.megatron.discovery import ChunkRouters
from r3bridge.megatron.installed import InstalledMicroBatch, PendingRecompute
from r3bridge.megatron.policy_stats import PolicyStats, per_token
from r3bridge.megatron.recorder import gather_recorded, gather_recorded_weights, with_recorded_weights
from r3bridge.metrics import AgreementCounter, topk_sets_equal
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.read import ReadStats, read_targets
from r3bridge.parallel.targets import ShardedTargets
from r3bridge.replay_policy import threshold_select

logger = logging.getLogger("r3bridge")


@dataclass
class MicroBatch:
    """What one micro-batch installs: its sequences as the trainer packs them.

    ``routes`` (a :class:`r3bridge.ReplayBatch`, or the framework's buffers as
    :class:`r3bridge.parallel.handed.HandedRoutes`: what the one reader reads) covers the leading
    sequences (REPLAY; ``None`` when recording); trailing sequences
    beyond ``routes.num_seqs`` must be padding. ``sample_ids``: the batch-level sample of each
    sequence, ``None`` for a padding sequence (no sample: routed natively, never recorded); left
    out, sequences are numbered in install order. The packing fields are
    :meth:`ReplayPass.install`'s. ``uids``: the framework's own name of each
    sequence's sample (``None`` for padding), written to route traces only."""

    seq_lens: Sequence[int]
    routes: Optional[Union[ReplayBatch, HandedRoutes]] = None
    sample_ids: Optional[Sequence[Optional[int]]] = None
    format: str = "thd"
    cu_seqlens_padded: Any = None
    seq_length: Optional[int] = None
    uids: Optional[Sequence[Any]] = None


class PassHost(Protocol):
    """What a :class:`ReplayPass` reads from the object that hands it out (a
    :class:`r3bridge.megatron.Replayer`): the model's routers, this rank's place, the replay
    options, and the slot holding the active pass."""

    # the model's routers and this rank's place in the layout
    chunks: list[ChunkRouters]
    layer_chunk: dict[int, int]
    layout: ParallelLayout
    tp_rank: int
    cp_rank: int
    pp_rank: int
    groups: dict[str, Any]
    metrics_groups: list[Any]
    num_experts: int
    topk: int
    # the replay options
    agreement: bool
    min_coverage: float
    coverage_floor: float
    degenerate_routes: str
    invalid_rows: str
    metrics_prefix: str
    mask_unrouted_rows: bool
    # the replay policy (r3bridge/replay_policy.py) and how this model's routers score experts
    replay_policy: str
    threshold_ratio: float
    score_space: str
    topk_scaling_factor: Optional[float]
    # at most one pass runs at a time; the router hooks forward to it
    active_pass: Optional[ReplayPass]
    read_stats: ReadStats                       # how routes reached the routers (docs/architecture.md, "One reader")

    @property
    def device(self) -> torch.device: ...

    def chunk_index(self, model: torch.nn.Module | int) -> int: ...


# AgreementCounter's columns
_AGREE, _COMPARED, _REPLAYED, _NATIVE = (AgreementCounter.FIELDS.index(f)
                                          for f in ("agree", "compared", "replayed", "native"))

# Rows of the router scores summed into the fingerprint: enough spread to tell micro-batches
# apart, few enough to be free next to the router's own matmul.
FINGERPRINT_ROWS = 16


def fingerprint(scores: torch.Tensor) -> torch.Tensor:
    """Row sums of up to FINGERPRINT_ROWS evenly spaced rows of ``scores`` (float32, on device):
    one kernel per router call (the sum reads the rows in their dtype and accumulates in float32)."""
    n = scores.shape[0]
    stride = max(1, n // FINGERPRINT_ROWS)
    return scores.detach()[::stride][:FINGERPRINT_ROWS].sum(-1, dtype=torch.float32)


def as_handed(routes: ReplayBatch | HandedRoutes) -> HandedRoutes:
    """What the reader reads: a framework's handed routes as they are, a ReplayBatch viewed."""
    return routes if isinstance(routes, HandedRoutes) else HandedRoutes.from_batch(routes)


def _as_key(x: Any) -> Any:
    if x is None:
        return None
    return tuple(x.tolist()) if isinstance(x, torch.Tensor) else tuple(int(v) for v in x)


def _sample_token_rows(rows: RankRows, ids: Sequence[int]) -> int:
    """This rank's rows of the samples' real tokens: packing padding and the padding sequences a
    trainer packs that are no sample (negative driver ids: appended by :meth:`ReplayPass.install`;
    a trainer's trailing page padding) are not tokens a route could cover, so coverage leaves them out
    and equals what a route trace reports (``r3bridge inspect``)."""
    padding = np.asarray(ids, dtype=np.int64) < 0
    if not padding.any() or not rows.seq.size:
        return rows.token_rows
    real = rows.pos < rows.plan.seq_lens.numpy()[rows.seq]
    return int((real & ~padding[rows.seq]).sum())


def _refuse_unrouted(rows: RankRows, routes: HandedRoutes, chunk: int, index: int) -> None:
    """``invalid_rows='error'``: a row of this rank without a route inside the rows its sequence
    was handed (the last token excepted: the last sampled token is never fed forward)."""
    if not rows.num_rows:
        return
    starts = np.asarray(routes.starts, dtype=np.int64)
    ends = starts + np.asarray(routes.rows, dtype=np.int64)
    lens = rows.plan.seq_lens.numpy()
    seq, pos = rows.seq, rows.pos
    inside = (pos >= starts[seq]) & (pos < np.minimum(ends, lens - 1)[seq])
    bad = np.flatnonzero(inside & ~rows.covered)
    if bad.size:
        r = int(bad[0])
        i = int(seq[r])
        raise CoverageError(f"chunk {chunk}, micro-batch {index}: {routes.name(i)}, row {int(pos[r] - starts[i])} "
                            f"(token {int(pos[r])}) has no route and invalid_rows='error'")


def _first_rank() -> bool:
    """Whether this process logs a pass's one line (rank 0, or no process group)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _check_topk(routes: ReplayBatch | HandedRoutes, topk: int, where: str) -> None:
    """Routes of another top-k than the model's routers, refused at install (not at the first
    router call), naming the micro-batch and its samples; routes without one route got their
    top-k from their shape, not from the model (aborted samples only: build them with the model's)."""
    if routes.topk == topk:
        return
    why = (" and not one valid row: its samples have no routes (aborted?), so that top-k came from the "
           "batch's shape; build their ReplayBatch with the model's top-k" if not as_handed(routes).any_route() else "")
    raise ReplayStateError(f"{where}: routes of top-{routes.topk}, the model's routers choose top-{topk}{why}")


class ReplayPass:
    """Created by :meth:`Replayer.open_pass`; use as a context manager. A phase's pass
    (:meth:`r3bridge.session.PhaseRunner.run`) also carries its ``phase``, ``plan``,
    ``provenance`` check and, on a clean exit, its ``result`` (:class:`r3bridge.session.PhaseResult`)."""

    def __init__(self, replayer: PassHost, action: Action | str, *, forward_only: bool,
                 route_kind: str | None = None, replay_weights: bool = False, record_weights: bool = False) -> None:
        self.replayer = replayer
        self.action = Action(action)
        self.forward_only = forward_only
        self.route_kind = route_kind        # the plan's: "rollout" (R3) or "recorded" (R2)
        # routing weights (combine_weights.py): replay the routes' weights / record the ones used
        self.replay_weights = bool(replay_weights)
        self.record_weights = bool(record_weights)
        if self.action is Action.RECORD and not forward_only:
            raise ConfigError("R2 recording runs in the forward-only compute_log_prob pass (forward_only=True)")
        if self.replay_weights and self.action is not Action.REPLAY:
            raise ConfigError(f"replay_weights: a {self.action.value} pass replays no routes, so no weights")
        if self.replay_weights and replayer.replay_policy != "hard":
            raise ConfigError(f"replay_weights with replay_policy={replayer.replay_policy!r}: the policy swaps some "
                              f"replayed experts for native ones, which the handed weights are not for; use 'hard'")
        if self.record_weights and (self.action is Action.NATIVE or not forward_only):
            raise ConfigError("record_weights: the combine weights are recorded in a forward-only compute_log_prob "
                              "pass that records (R2) or replays (R3)")
        n = len(replayer.chunks)
        self._next_index = [0] * n
        self._next_sample = [0] * n
        self._last: list[Optional[InstalledMicroBatch]] = [None] * n
        self._current: list[Optional[InstalledMicroBatch]] = [None] * n
        self._live: dict[tuple[int, int], InstalledMicroBatch] = {}
        self._recompute: dict[int, deque[PendingRecompute]] = {lid: deque() for lid in replayer.layer_chunk}
        # per recompute: (layer, chunk, micro-batch) and a device bool "fingerprint differs"
        self._pairings: list[tuple[int, int, int]] = []
        self._pair_mismatch: list[torch.Tensor] = []
        self._done_records: list[InstalledMicroBatch] = []
        # micro-batch index -> (its key, this rank's row map): one per micro-batch, every chunk's
        self._reads: dict[int, list] = {}
        # per install: (sample ids, per-sequence counts of the read) -> the per-sample metrics
        self._sample_rows: list[tuple[list[int], Any]] = []
        self._handles: list[Any] = []
        self.stats_unmasked = 0                 # router calls whose unrouted rows stayed in the statistics
        self.recorded: Optional[ReplayBatch] = None
        self.metrics: dict[str, float] = {}
        self.trace: Any = None                  # a PassTrace while the pass is traced (megatron/trace.py)
        # a phase's pass (PhaseRunner.serve): its runner (the job's options), phase, plan, provenance, result
        self.runner: Any = None
        self.phase: Optional[Phase] = None
        self.plan: Optional[PhasePlan] = None
        self.provenance: Optional[ProvenanceCount] = None     # R3: the pass's provenance check
        self.result: Any = None
        # MicroBatch installs, per micro-batch index (every chunk's): (sample ids, the driver's ids)
        self._ids: dict[int, tuple[list[Optional[int]], list[int]]] = {}
        self._installed: dict[int, int] = {}    # chunk -> MicroBatch installs
        self._built: dict[int, list] = {}       # micro-batch -> [its MicroBatch, chunks yet to install it]
        self.uids: dict[int, list[Optional[str]]] = {}   # micro-batch -> MicroBatch.uids
        self._next_id = 0
        self._next_pad = -1
        dev = self.device = replayer.device     # fixed for this schedule run
        # Every MoE layer of the model (not just this stage's), so one all_reduce over the
        # model-parallel group sums every stage; fed on device, no host sync per router call.
        self._counter = AgreementCounter(replayer.layout.moe_layer_ids, device=dev)
        # The counts known on the host (rows compared, replayed, routed natively: Python ints per
        # router call) add up here and reach the device counter once, at the end of the pass; the
        # agreement sums (device scalars) are kept per call and added there in one kernel: a
        # router call launches no counting kernel of its own (P3: what replay adds per call).
        self._host_counts = np.zeros(self._counter.counts.shape, dtype=np.int64)
        self._agree_sums: list[tuple[int, torch.Tensor]] = []
        # replay policy / router log-ratio (r3bridge/megatron/policy_stats.py)
        self.policy = PolicyStats(replayer.metrics_prefix, device=dev)
        self.weights = CombineWeights(replayer.metrics_prefix, device=dev, scaling_factor=replayer.topk_scaling_factor)

    @property
    def records(self) -> bool:
        """Whether the pass records the routes it routed with (R2's recording, or R3w's)."""
        return self.action is Action.RECORD or self.record_weights

    # ---------------------------------------------------------------------------- context
    def __enter__(self) -> "ReplayPass":
        if self.replayer.active_pass is not None:
            raise ReplayStateError("a replay pass is already active: passes do not nest")
        for c, found in enumerate(self.replayer.chunks):
            self._handles.append(found.chunk.register_forward_pre_hook(self._make_pre(c)))
            self._handles.append(found.chunk.register_forward_hook(self._make_post(c)))
        if self.action is Action.REPLAY and self.replayer.mask_unrouted_rows:
            self._handles += stats_mask.attach([found.routers for found in self.replayer.chunks], self)
        if self.action is Action.REPLAY:
            self._handles += self.policy.attach([found.routers for found in self.replayer.chunks], self)
        if self.replay_weights or self.record_weights:     # last: the hooks above read the live router's output
            self._handles += self.weights.attach([found.routers for found in self.replayer.chunks])
        self.replayer.active_pass = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._check_drained()
                self.metrics = self._finish_metrics()
                if self.records:
                    rep = self.replayer
                    chunk_layer_ids = [found.layer_ids for found in rep.chunks]
                    self.recorded = gather_recorded(
                        self._done_records, layout=rep.layout, chunk_layer_ids=chunk_layer_ids,
                        pp_rank=rep.pp_rank, groups=rep.groups, num_experts=rep.num_experts, topk=rep.topk,
                        device=rep.device)
                    if self.record_weights:
                        self.recorded = with_recorded_weights(self.recorded, gather_recorded_weights(
                            self._done_records, layout=rep.layout, chunk_layer_ids=chunk_layer_ids,
                            pp_rank=rep.pp_rank, groups=rep.groups, topk=rep.topk, device=rep.device))
        finally:
            self.close()

    def close(self) -> None:
        """Drop every target, record, queue and module hook (also after an exception)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._live.clear()
        self._done_records = []
        for q in self._recompute.values():
            q.clear()
        self._pairings.clear()
        self._pair_mismatch.clear()
        self._agree_sums.clear()
        self._reads.clear()
        self._built.clear()
        self._sample_rows = []
        self.policy.clear()
        self.weights.clear()
        self._current = [None] * len(self._current)
        self._last = [None] * len(self._last)
        if self.replayer.active_pass is self:
            self.replayer.active_pass = None

    # ---------------------------------------------------------------------------- install
    def install(self, model: torch.nn.Module | int,
                routes: ReplayBatch | HandedRoutes | MicroBatch | Callable[[], MicroBatch] | None,
                seq_lens: Sequence[int] | None = None, *, cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
                format: str = "thd", seq_length: int | None = None, sample_ids: Sequence[int] | None = None,
                index: int | None = None) -> int | None:
        """Targets of the next micro-batch of ``model``'s chunk; call right before its forward.

        An adapter's pass: ``install(model, MicroBatch(...))`` (or a callable building the
        :class:`MicroBatch`, called by the micro-batch's first install only: under VPP every later
        chunk reuses it, so the framework's routes are decoded and its packing read once per
        micro-batch); ``index``: the micro-batch's position in the schedule (chunks after the first
        repeat it). Returns that position (what :meth:`router_log_ratio_tokens` takes).

        The driver's own form: ``install(model, routes, seq_lens, ...)``, ``routes`` a
        :class:`r3bridge.ReplayBatch` or what the framework handed over
        (:class:`r3bridge.parallel.handed.HandedRoutes`), read by the one reader (docs/architecture.md,
        "One reader"); the sequences are numbered in install order unless ``sample_ids`` says.

        In a NATIVE pass (replay off, reference model) this is a no-op, so adapters can call it
        unconditionally."""
        if isinstance(routes, MicroBatch) or callable(routes):
            if seq_lens is not None:
                raise TypeError("install(model, MicroBatch) takes the packing from the MicroBatch, not seq_lens")
            return self._install_micro_batch(model, routes, index)
        if seq_lens is None:
            raise TypeError("install(model, routes, seq_lens, ...) needs seq_lens (or a MicroBatch)")
        c = self.replayer.chunk_index(model)
        lens = list(_as_key(seq_lens))
        # default: samples numbered in install order across this pass's micro-batches
        first = self._next_sample[c]
        ids = list(range(first, first + len(lens))) if sample_ids is None else [int(s) for s in sample_ids]
        if len(ids) != len(lens):
            raise CoverageError(f"sample_ids has {len(ids)} entries for {len(lens)} sequences")
        self._install(c, routes, lens, dict(format=format, cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length),
                      ids)
        return None

    def _install(self, c: int, routes: ReplayBatch | HandedRoutes | None, lens: list[int], pack: dict,
                 ids: list[int]) -> None:
        """The install both forms share: chunk ``c``'s next micro-batch, ``ids`` the driver's id
        of each sequence (checked by the caller)."""
        if self.replayer.active_pass is not self:
            # outside its `with` block no router would ever see these targets: every router
            # would route natively and the pass would report nothing (field notes 8.1: a silent no-op)
            raise ReplayStateError(f"chunk {c}: install() on a replay pass that is not active: use "
                                   f"`with replayer.open_pass(...) as driver_pass:` around the schedule")
        if self.action is Action.NATIVE:
            return
        last = self._last[c]
        if last is not None and not last.forwarded:
            raise ReplayStateError(f"chunk {c}: micro-batch {last.index} was installed but never ran forward "
                                   f"before the next install")
        rep = self.replayer
        layers = rep.chunks[c].layer_ids
        index = self._next_index[c]
        handed = None if routes is None or self.action is not Action.REPLAY else as_handed(routes)
        rows, handed = self._rank_rows(index, lens, pack, handed)
        token_rows = _sample_token_rows(rows, ids)
        mb = InstalledMicroBatch(c, index, rows.num_rows, token_rows, lens, pack, ids, plan=rows.plan)
        if self.action is Action.REPLAY:
            if handed is None:
                raise ReplayStateError(f"chunk {c}, micro-batch {mb.index} (samples {ids}): replay pass without routes")
            self._check_route_kind(handed)
            _check_topk(handed, rep.topk, f"chunk {c}, micro-batch {mb.index} (samples {ids})")
            if self.replay_weights and not handed.has_weights:
                raise RouteWeightsError(
                    f"chunk {c}, micro-batch {mb.index} (samples {ids}): replay_weights replays the combine weights "
                    f"of the routes, and these {handed.route_kind} routes carry none"
                    + (" (replay_weights=recorded: the compute_log_prob pass records them with record_weights)"
                       if handed.route_kind == "recorded" else
                       " (an engine's weights: SGLang --enable-return-routed-expert-weights; or "
                       "replay_weights=recorded)"))
            if rep.invalid_rows == "error":
                _refuse_unrouted(rows, handed, c, mb.index)
            counts: list = []
            rep.read_stats.reads += 1
            mb.targets = read_targets(handed, rows, layers, device=self.device, degenerate=rep.degenerate_routes,
                                      counts=counts, where=f"rank (pp={rep.pp_rank}, vp={c})",
                                      model_layers=rep.layout.moe_layer_ids)
            self._sample_rows.append((ids, counts[0]))
            nvalid = mb.targets.num_valid       # counted on the host: no device sync per install
            if rep.min_coverage > 0:
                # over this rank's real tokens of samples with routes: packing padding never has a
                # route, and a sample handed with 0 rows (aborted) is counted apart
                routed = rows.token_rows - rows.unrouted_token_rows
                cov = nvalid / routed if routed else 1.0
                if cov < rep.min_coverage:
                    raise CoverageError(f"chunk {c}, micro-batch {mb.index} (samples {ids}): only {cov:.3f} of this "
                                        f"rank's {routed} token rows have a route (min_coverage={rep.min_coverage}; "
                                        f"{rows.unrouted_token_rows} rows of samples without routes counted apart)")
            mb.all_valid = nvalid == mb.rows
            mb.batch_has_route = handed.any_route()
            mb.routes = handed
            mb.rank_rows = rows
            if self.trace is not None and c == 0:
                self.trace.handed_routes(mb, handed)
        elif routes is not None and self.action is not Action.NATIVE:
            raise ReplayStateError(f"chunk {c}: routes given to a {self.action.value} pass")
        mb.fwd_left = set(layers)
        self._next_index[c] += 1
        self._next_sample[c] = max(self._next_sample[c], max(ids, default=-1) + 1)
        self._last[c] = mb
        self._live[(c, mb.index)] = mb

    # ---------------------------------------------------------------------------- a phase's MicroBatch installs
    def serve(self, runner: Any, phase: Phase, plan: PhasePlan, provenance: Optional[ProvenanceCount]) -> None:
        """Make this the pass of ``phase`` (:meth:`r3bridge.session.PhaseRunner.run`): ``runner``
        holds the job's options, ``provenance`` the R3 check made before the pass opened."""
        self.runner, self.phase, self.plan, self.provenance = runner, Phase(phase), plan, provenance

    def _install_micro_batch(self, model: torch.nn.Module | int, mb: MicroBatch | Callable[[], MicroBatch],
                             index: Optional[int]) -> int:
        c = self.replayer.chunk_index(model)
        k = self._installed.get(c, 0) if index is None else int(index)
        self._installed[c] = k + 1
        if callable(mb):
            mb = self._built_once(k, mb)
        lens = list(_as_key(mb.seq_lens))
        known = self._ids.get(k)
        if known is None:
            known = self._ids[k] = self._sample_ids(mb, len(lens), k)
            if mb.uids is not None:             # route traces name samples by them
                self.uids[k] = [None if u is None else str(u) for u in mb.uids]
        elif len(known[0]) != len(lens):
            raise ReplayStateError(f"chunk {c}, micro-batch {k}: {len(lens)} sequences, another chunk installed "
                                   f"{len(known[0])}")
        elif mb.sample_ids is not None and [None if x is None else int(x) for x in mb.sample_ids] != known[0]:
            raise ReplayStateError(f"chunk {c}, micro-batch {k}: sample ids {list(mb.sample_ids)}, another chunk "
                                   f"installed {known[0]}")
        ids, driver_ids = known
        routes = mb.routes
        config = None if self.runner is None else self.runner.config
        if self.action is Action.REPLAY:
            if routes is None:
                mode = self.action.value if config is None else config.replay_mode.value
                raise ReplayStateError(f"chunk {c}, micro-batch {k} (samples {ids}): a {mode} replay without routes")
            routes = as_handed(routes)          # a ReplayBatch is viewed, never copied
            extra = len(lens) - routes.num_seqs
            if extra < 0 or any(s is not None for s in ids[routes.num_seqs:]):
                raise CoverageError(f"chunk {c}, micro-batch {k}: routes for {routes.num_seqs} sequences, "
                                    f"{len(lens)} packed of which {sum(s is None for s in ids)} padding")
            if extra:
                routes = routes.with_empty_sequences(lens[routes.num_seqs:])
            if config is not None and config.router_log_ratio and not routes.has_weights:
                raise ConfigError(f"chunk {c}, micro-batch {k}: router_log_ratio=true needs the rollout's routing "
                                  f"weights, and these routes carry none (SGLang: "
                                  f"--enable-return-routed-expert-weights)")
        self._install(c, routes, lens, dict(format=mb.format, cu_seqlens_padded=mb.cu_seqlens_padded,
                                            seq_length=mb.seq_length), driver_ids)
        return k

    def _built_once(self, index: int, build: Callable[[], MicroBatch]) -> MicroBatch:
        """Micro-batch ``index`` built by its first chunk's install and handed to every later
        chunk's; dropped once every chunk installed it (the pass keeps no copy)."""
        hit = self._built.get(index)
        if hit is None:
            hit = self._built[index] = [build(), len(self.replayer.chunks)]
        hit[1] -= 1
        if hit[1] <= 0:
            del self._built[index]
        return hit[0]

    def _sample_ids(self, mb: MicroBatch, n: int, k: int) -> tuple[list[Optional[int]], list[int]]:
        """(sample ids, None for padding; the ids the driver gets). Padding sequences need ids
        distinct from every sample's: negative ones, which no sample id is; the recording is
        selected by the padding flags, never by an id's value."""
        if mb.sample_ids is None:
            ids: list[Optional[int]] = list(range(self._next_id, self._next_id + n))
        else:
            ids = [None if s is None else int(s) for s in mb.sample_ids]
            if len(ids) != n:
                raise CoverageError(f"micro-batch {k}: {len(ids)} sample ids for {n} sequences")
            if any(s is not None and s < 0 for s in ids):
                raise CoverageError(f"micro-batch {k}: negative sample id in {ids}")
        real = [s for s in ids if s is not None]
        self._next_id = max([self._next_id, *[s + 1 for s in real]])
        driver = []
        for s in ids:
            if s is None:
                s, self._next_pad = self._next_pad, self._next_pad - 1
            driver.append(s)
        return ids, driver

    def installed_sample_ids(self, index: int) -> Optional[list[Optional[int]]]:
        """The batch-level sample ids installed for micro-batch ``index`` by :class:`MicroBatch`
        installs (None: not installed)."""
        known = self._ids.get(index)
        return None if known is None else known[0]

    def recorded_samples(self) -> ReplayBatch:
        """RECORD, after the pass: :attr:`recorded` of the real samples only (no padding
        sequence), in sample-id order."""
        rec = self.recorded
        # the driver returns every installed sequence sorted by driver id; keep the samples
        flat = [(d, s is not None) for k in sorted(self._ids) for s, d in zip(*self._ids[k])]
        if rec is None or rec.num_seqs != len(flat):
            raise ReplayStateError(f"R2 recorded {None if rec is None else rec.num_seqs} sequences, "
                                   f"{len(flat)} were installed")
        order = sorted(range(len(flat)), key=lambda i: flat[i][0])
        keep = [pos for pos, i in enumerate(order) if flat[i][1]]
        return rec if len(keep) == rec.num_seqs else rec.select(keep)

    def _rank_rows(self, index: int, lens: list[int], pack: dict, handed: Optional[HandedRoutes]
                   ) -> tuple[RankRows, Optional[HandedRoutes]]:
        """The pack plan and this rank's row map of micro-batch ``index`` (covered by its routes),
        built by its first chunk's install and shared by every chunk's (VPP: the routes are read
        from the first chunk's handed routes, never decoded again) and by late recomputes."""
        key = (tuple(lens), pack.get("format"), _as_key(pack.get("cu_seqlens_padded")), pack.get("seq_length"),
               handed is not None)
        rep = self.replayer
        hit = self._reads.get(index)
        if hit is None or hit[0] != key:
            rows = RankRows.build(rep.layout, lens, tp_rank=rep.tp_rank, cp_rank=rep.cp_rank, **pack)
            rep.read_stats.row_maps += 1
            if handed is not None:
                rows = rows.cover(handed)
                rep.read_stats.saw(handed)
            hit = [key, rows, handed, len(rep.chunks)]
            self._reads[index] = hit
        hit[3] -= 1
        if hit[3] <= 0:                 # every chunk installed it: the pass keeps no copy
            self._reads.pop(index, None)
        return hit[1], hit[2]

    def _check_route_kind(self, routes: ReplayBatch | HandedRoutes) -> None:
        want, got = self.route_kind, routes.route_kind
        if want == "recorded" and got != "recorded" and self.replay_weights:
            raise ConfigError(f"this update replays the routes and combine weights recorded in compute_log_prob "
                              f"(replay_weights=recorded), got {got} routes{f' of {routes.engine}' if routes.engine else ''}: "
                              f"hand the update the compute_log_prob pass's recording (PhaseResult.recorded)")
        if want == "recorded" and got != "recorded":
            raise ConfigError(f"R2 update must replay the routes recorded in compute_log_prob, got {got} routes"
                              f"{f' of {routes.engine}' if routes.engine else ''} (a framework that replays "
                              f"rollout routes under R2 does so silently: field notes 8.8)")
        if want == "rollout" and got == "recorded":
            raise ConfigError("R3 replays the rollout engine's routes, got routes recorded by the trainer")
        if want == "rollout" and got != "rollout":
            raise ConfigError(f"R3 replays the rollout engine's routes, got {got} routes")

    # ---------------------------------------------------------------------------- forward hooks
    def _make_pre(self, c: int):
        def pre(module, args, kwargs=None):
            if self.action is Action.NATIVE:
                return None
            mb = self._last[c]
            if mb is None or mb.forwarded:
                raise ReplayStateError(f"chunk {c}: forward of micro-batch {self._next_index[c]} without "
                                       f"install(): refusing to route natively under {self.action.value}")
            if self._current[c] is not None:
                raise ReplayStateError(f"chunk {c}: nested forward")
            self._current[c] = mb
            return None
        return pre

    def _make_post(self, c: int):
        def post(module, args, output):
            mb = self._current[c]
            self._current[c] = None
            if mb is None:
                return None
            mb.forwarded = True
            if mb.fwd_left:
                raise ReplayStateError(f"chunk {c}, micro-batch {mb.index}: routers of layers {sorted(mb.fwd_left)} "
                                       f"did not run in the forward")
            self._retire(mb)
            return None
        return post

    def _retire(self, mb: InstalledMicroBatch) -> None:
        if mb.forwarded and not mb.recompute_left:
            self._live.pop((mb.chunk, mb.index), None)
            mb.targets = None
            if self.records:
                self._done_records.append(mb)

    def micro_batch_of_call(self, chunk: int, layer: int) -> Optional[InstalledMicroBatch]:
        """The micro-batch a router call of ``layer`` in ``chunk`` belongs to, as :meth:`route`
        will find it: the one in the chunk's forward, else the oldest recompute queued for the
        layer (``None``: neither)."""
        mb = self._current[chunk]
        if mb is not None:
            return mb
        queue = self._recompute.get(layer)
        return queue[0].micro_batch if queue else None

    # ---------------------------------------------------------------------------- routing
    def route(self, c: int, layer: int, scores: torch.Tensor, topk: int, num_groups, group_topk, native_fn):
        if self.action is Action.NATIVE:
            return native_fn(scores, topk, num_groups=num_groups, group_topk=group_topk)
        mb = self._current[c]
        in_forward = mb is not None
        if in_forward:
            if layer not in mb.fwd_left:
                raise ReplayStateError(f"chunk {c}, micro-batch {mb.index}: layer {layer} routed twice in one forward")
            mb.fwd_left.discard(layer)
            if not self.forward_only:
                kept = not torch.is_grad_enabled()
                if kept:        # reentrant checkpoint's first pass: its recompute is certain (unless frozen)
                    mb.recompute_left.add(layer)
                self._recompute[layer].append(PendingRecompute(mb, fingerprint(scores), kept))
            pending = None
        else:
            q = self._recompute[layer]
            if not q:
                raise ReplayStateError(f"layer {layer}: router called outside any forward with no recompute pending "
                                       f"(a forward not bracketed by the schedule?)")
            pending = q.popleft()
            mb = pending.micro_batch
            mb.recompute_left.discard(layer)
        if scores.shape[0] != mb.rows:
            raise ReplayStateError(f"layer {layer}, chunk {c}, micro-batch {mb.index} (tp={self.replayer.tp_rank}, "
                                   f"cp={self.replayer.cp_rank}, pp={self.replayer.pp_rank}): the router sees "
                                   f"{scores.shape[0]} rows, the packing plan gives {mb.rows}")
        if pending is not None:
            fp = fingerprint(scores)
            self._pairings.append((layer, mb.chunk, mb.index))
            self._pair_mismatch.append(~torch.isclose(fp, pending.fingerprint, rtol=1e-3, atol=1e-3,
                                                      equal_nan=True).all())
        if self.action is Action.RECORD:
            probs, idx = native_fn(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if in_forward:
                mb.recorded[layer] = idx.detach().to(route_dtype(self.replayer.num_experts))
                if self.record_weights:
                    self.weights.expect_record(c, layer, mb, idx)
                if self.trace is not None:
                    self.trace.routed(mb, layer, idx, None, None)
            out = probs, idx
        else:
            t = mb.targets
            if pending is not None and not pending.kept_target:
                t = self._late_target(mb, layer)
            out = self._replay(mb, t, layer, scores, topk, num_groups, group_topk, native_fn, count=in_forward)
            if self.record_weights and in_forward:     # R3w: the ids used (the engine's; native on rows without)
                mb.recorded[layer] = out[1].detach().to(route_dtype(self.replayer.num_experts))
                self.weights.expect_record(c, layer, mb, out[1])
        if mb.targets is not None and layer not in mb.fwd_left and layer not in mb.recompute_left:
            mb.targets.indices.pop(layer, None)   # used up: a second use is an error (the block is freed with the last)
        if not in_forward:
            self._retire(mb)
        return out

    def _late_target(self, mb: InstalledMicroBatch, layer: int) -> ShardedTargets:
        """The target of ``layer`` for a recompute whose first pass ran with grad enabled (a
        non-reentrant checkpoint): that first pass freed it, so read it again, this layer only,
        by the micro-batch's row map."""
        rep = self.replayer
        if mb.routes is None or mb.rank_rows is None:
            raise ReplayStateError(f"layer {layer}, chunk {mb.chunk}, micro-batch {mb.index}: recompute without routes")
        rep.read_stats.reads += 1
        return read_targets(mb.routes, mb.rank_rows, [layer], device=self.device, degenerate=rep.degenerate_routes)

    def _replay(self, mb: InstalledMicroBatch, t: Optional[ShardedTargets], layer: int, scores, topk, num_groups,
                group_topk, native_fn, *, count: bool):
        assert t is not None
        target = t.indices.get(layer)
        if target is None:
            raise ReplayStateError(f"layer {layer}, chunk {mb.chunk}, micro-batch {mb.index}: no target left "
                                   f"(consumed already?)")
        idx = target
        threshold = self.replayer.replay_policy == "threshold"
        need_native = not mb.all_valid or threshold or ((self.replayer.agreement or self.trace is not None) and count)
        kept = None
        if need_native:
            native = native_fn(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
            if threshold:
                idx, replaced = threshold_select(scores, target, native, ratio=self.replayer.threshold_ratio,
                                                 score_space=self.replayer.score_space, valid=t.valid)
                kept = ~replaced
                if count:
                    self.policy.count_replaced(replaced, t.num_valid, topk)
            if not mb.all_valid:
                idx = torch.where(t.valid[:, None], idx, native)
            if count:
                if self.trace is not None:
                    self.trace.routed(mb, layer, native, target, t.valid)
                if self.replayer.agreement:
                    same = topk_sets_equal(native, target) & t.valid
                    slot = self._counter.slot(layer)
                    self._agree_sums.append((slot, same.sum()))
                    self._host_counts[slot, _COMPARED] += t.num_valid
        if count:
            # coverage is over real tokens: packing padding never has a route, so the valid rows
            # (counted on the host at install) are the replayed tokens and the rest went native
            slot = self._counter.slot(layer)
            self._host_counts[slot, _REPLAYED] += t.num_valid
            self._host_counts[slot, _NATIVE] += mb.token_rows - t.num_valid
            if t.weights is not None:       # the router's output gives the trainer's gate weights
                self.policy.expect(mb, layer, idx, t.weights[layer], t.valid, kept)
        if self.replay_weights:
            if t.weights is None:           # refused at install; a late recompute re-reads the same routes
                raise RouteWeightsError(f"layer {layer}, chunk {mb.chunk}, micro-batch {mb.index} (samples "
                                        f"{mb.sample_ids}): replay_weights but the routes read carry no weights")
            # recorded weights are the router's final ones; an engine's come before the routed scaling factor
            self.weights.expect_replay(mb.chunk, layer, idx, t.weights[layer], t.valid,
                                       scaled=self.route_kind == "recorded")
            if count:
                self.weights.count(t.num_valid, mb.token_rows - t.num_valid)
        return scores.gather(1, idx), idx

    def _fold_counts(self) -> None:
        """The pass's host counts and per-call agreement sums into the device counter, before the
        counts are summed over the ranks: a few kernels per pass, whatever its router calls (the
        sums go to their layers through a 0/1 matrix built on the host: a plain product and sum,
        exact for integers and deterministic, no atomics)."""
        counts = self._counter.counts
        if self._host_counts.any():
            counts += torch.from_numpy(self._host_counts).to(counts.device)
            self._host_counts[:] = 0
        if self._agree_sums:
            onehot = np.zeros((len(self._agree_sums), counts.shape[0]), dtype=np.int64)
            onehot[np.arange(len(self._agree_sums)), [slot for slot, _ in self._agree_sums]] = 1
            sums = torch.stack([v for _, v in self._agree_sums]).to(counts.dtype)
            counts[:, _AGREE] += (sums[:, None] * torch.from_numpy(onehot).to(counts.device)).sum(0)
            self._agree_sums.clear()

    def _sum_counts(self, groups: Sequence[Any]) -> None:
        """Sum the agreement counts, the replay policy's counts and the per-sample read counts over
        the metrics groups in one all_reduce per group (the pass's only collectives): the int64
        counts travel as float64, exact below 2**53, next to the policy's float64 sums."""
        import torch.distributed as dist

        if not groups or not (dist.is_available() and dist.is_initialized()):
            return
        counts, per_sample = self._counter.counts, self._per_sample
        flat = torch.cat([counts.flatten().to(torch.float64), self.policy.counts, self.weights.counts,
                          per_sample.flatten().to(device=counts.device, dtype=torch.float64)])
        for group in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        n, m, w = counts.numel(), self.policy.counts.numel(), self.weights.counts.numel()
        counts.copy_(flat[:n].round().view_as(counts).to(counts.dtype))
        self.policy.counts.copy_(flat[n:n + m])
        self.weights.counts.copy_(flat[n + m:n + m + w])
        per_sample.copy_(flat[n + m + w:].round().view_as(per_sample).to(per_sample.dtype))

    def router_log_ratio(self, chunk: int, index: int) -> Optional[torch.Tensor]:
        """The router log-ratio of micro-batch ``index`` of ``chunk`` on this rank: float32
        ``[rows]`` in router row order, summed over the chunk's MoE layers (``None``: its routes
        carry no weights). Complete once the chunk's forward of that micro-batch has run."""
        return self.policy.log_ratio.get((chunk, index))

    def router_log_ratio_tokens(self, model: torch.nn.Module | int, index: int) -> Optional[list[torch.Tensor]]:
        """The router log-ratio of micro-batch ``index`` (every MoE layer of ``model``'s chunk:
        the chunk or its index), one ``[seq_len]`` tensor per packed sequence, position ``j`` the
        routes at position ``j`` (:mod:`r3bridge.replay_policy`), every TP / CP rank's rows
        gathered (:func:`r3bridge.megatron.policy_stats.per_token`). ``None`` when its routes
        carry no weights. Call after the chunk's forward of that micro-batch (from the loss)."""
        chunk = self.replayer.chunk_index(model)
        ratio = self.policy.log_ratio.get((chunk, index))
        if ratio is None:
            return None
        rep = self.replayer
        return per_token(ratio, self.policy.micro_batches[(chunk, index)], rep.layout, tp_rank=rep.tp_rank,
                         cp_rank=rep.cp_rank, groups=rep.groups)

    # ---------------------------------------------------------------------------- end of pass
    def _check_drained(self) -> None:
        left = [(mb.chunk, mb.index) for mb in self._live.values() if not mb.forwarded]
        if left:
            raise ReplayStateError(f"installed micro-batches never ran forward: (chunk, micro-batch) {left}")
        if self._pair_mismatch:
            bad = torch.stack(self._pair_mismatch).nonzero()      # the one host sync of the check
            if bad.numel():
                layer, chunk, index = self._pairings[int(bad[0, 0])]
                raise ReplayStateError(
                    f"layer {layer}, chunk {chunk}, micro-batch {index}: the recompute's router scores differ "
                    f"from that micro-batch's checkpointed first pass ({int(bad.numel())} of "
                    f"{len(self._pairings)} recomputes differ): backward did not run in forward order, so "
                    f"recomputes replayed another micro-batch's routes")

    def _finish_metrics(self) -> dict[str, float]:
        if self.action is not Action.REPLAY:
            return {}
        self._per_sample = self._sample_counts()
        self._fold_counts()
        self._sum_counts(self.replayer.metrics_groups)
        out = self._counter.as_metrics(self.replayer.metrics_prefix)
        if self.stats_unmasked:
            out[f"{self.replayer.metrics_prefix}stats_unmasked_calls"] = float(self.stats_unmasked)
        out.update(self.policy.metrics(threshold=self.replayer.replay_policy == "threshold"))
        if self.replay_weights:
            out.update(self.weights.metrics())
        per_sample = self._per_sample.cpu().numpy()      # one copy to the host per pass, read twice below
        out.update(self._sample_metrics(per_sample))
        if not self.replayer.agreement:
            out = {k: v for k, v in out.items() if "/agreement/" not in k}
        self._check_floor(out, per_sample)
        return out

    def _sample_counts(self) -> torch.Tensor:
        """int64 ``[samples, 4]`` ((row, layer) pairs replayed, degenerate pairs, real-token pairs,
        rows handed) per sample of the pass, in sample-id order, as this rank read them; padding
        sequences (negative ids) are no sample. Summed over the ranks by :meth:`_sum_counts`."""
        per: dict[int, list[int]] = {}
        for ids, counts in self._sample_rows:
            for sid, *values in zip(ids, counts.replayed.tolist(), counts.degenerate.tolist(),
                                    counts.token_pairs.tolist(), counts.handed.tolist()):
                if sid >= 0:
                    acc = per.setdefault(int(sid), [0, 0, 0, 0])
                    for col, v in enumerate(values):
                        acc[col] += v
        return torch.tensor([per[s] for s in sorted(per)], dtype=torch.int64, device=self.device).reshape(-1, 4)

    def _sample_metrics(self, per_sample: np.ndarray) -> dict[str, float]:
        """Per-sample counts of the pass: ``samples/replayed`` (some route replayed, none refused),
        ``samples/native`` (rows handed, none a route: routed natively), ``samples/without_routes``
        (handed with 0 rows: aborted or interrupted, routed natively, counted apart),
        ``samples/refused`` (some route degenerate, routed natively under ``degenerate_routes:
        native``), and ``degenerate_pairs`` (the (token, layer) pairs whose ids repeat), from every
        rank's counts summed."""
        replayed, degenerate, _, handed = per_sample.T
        refused = degenerate > 0
        without = handed == 0
        prefix = self.replayer.metrics_prefix
        return {f"{prefix}samples/replayed": float((~refused & (replayed > 0)).sum()),
                f"{prefix}samples/native": float((~refused & ~without & (replayed == 0)).sum()),
                f"{prefix}samples/without_routes": float(without.sum()),
                f"{prefix}samples/refused": float(refused.sum()),
                f"{prefix}degenerate_pairs": float(degenerate.sum())}

    def _check_floor(self, metrics: dict[str, float], per_sample: np.ndarray) -> None:
        """R3: a pass whose routes cover less than ``coverage_floor`` of the real tokens of its
        samples with routes (every rank, every MoE layer) fails here, after its schedule and before
        its result is used: an engine that returned no usable routes (vLLM #54730's all-zero rows
        read as "no route") never trains silently on native routing. Samples handed with 0 rows
        (aborted or interrupted) are counted apart: a pass of only such samples trains natively
        and says so (``samples/without_routes`` and one log line)."""
        floor = self.replayer.coverage_floor
        prefix = self.replayer.metrics_prefix
        _, _, pairs, handed = per_sample.T
        without = handed == 0
        if without.any() and without.all() and _first_rank():
            logger.warning("r3bridge: every sample of this %s replay pass (%d) came without routes (aborted or "
                           "interrupted: 0 rows handed for each): the pass routed natively", self.route_kind,
                           int(without.size))
        total = metrics.get(f"{prefix}replayed_pairs", 0.0) + metrics.get(f"{prefix}native_pairs", 0.0)
        routed_pairs = total - float(pairs[without].sum())
        cov = metrics.get(f"{prefix}replayed_pairs", 0.0) / routed_pairs if routed_pairs > 0 else float("nan")
        if floor <= 0 or self.route_kind != "rollout" or not cov == cov or cov >= floor:
            return
        raise CoverageError(
            f"R3 pass: the rollout routes cover {cov:.3f} of the routed (token, MoE layer) pairs of its samples "
            f"with routes ({int(without.sum())} samples without routes counted apart), below "
            f"r3bridge.coverage_floor={floor} ({int(metrics[f'{prefix}samples/replayed'])} samples replayed, "
            f"{int(metrics[f'{prefix}samples/native'])} with no route, {int(metrics[f'{prefix}samples/refused'])} "
            f"refused): did the engine return routes (vLLM enable_return_routed_experts, SGLang "
            f"--enable-return-routed-experts), and are they the model's?")
