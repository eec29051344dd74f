"""Writing route traces (the ``r3bridge`` options ``trace_dir``, ``trace_every``, ``trace_max_bytes``).

One implementation for every adapter: :class:`r3bridge.session.PhaseRunner` owns a
:class:`RunTracer` when ``trace_dir`` is set, opens a :class:`PassTrace` on the driver pass of
each traced pass, and the driver pass hands it, from inside the router hook, what each router call of a
forward routed: the router's own top-k (computed under replay anyway for the agreement metric)
and, in a replay pass, the replayed target. Everything stays on the device until the pass ends;
then each rank writes its own rows and layers (format: :mod:`r3bridge.trace.format`) and one index line.

Steps: the tracer counts RL steps itself, from 1 as the frameworks number them: a compute_log_prob
pass that follows an update starts the next step (frameworks that run no compute_log_prob stay in
step 1; their update passes are numbered). The routes the framework handed over for each sample (the
engine's for R3, the recorded ones for R2) are written once per data-parallel group, by its rank at
tp = cp = pp = 0 (view ``handed``), so ``r3bridge inspect`` can compare what the routers dispatched
with them token by token. Disk: each rank may write ``trace_max_bytes / world_size`` bytes; the pass that would
exceed it is not written, the rank writes a ``stopped`` index line, and every later pass counts
in the ``trace/dropped_passes`` metric. Ranks of one model-parallel group decide together (one
MAX all-reduce of a flag), so a pass is either written by all of them or by none.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.config import Action, Phase, PhasePlan, ReplayConfig
from r3bridge.metrics import tag_phase
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.trace.format import (
    append_index,
    layout_to_json,
    micro_batch_entry,
    payload_name,
    rank_batch,
    write_payload,
)

if TYPE_CHECKING:      # the driver's record of an install: the writer only reads its fields
    from r3bridge.megatron.installed import InstalledMicroBatch


class TracedReplayer(Protocol):
    """What the tracer reads of the driver (``r3bridge.megatron.Replayer``)."""

    layout: ParallelLayout
    num_experts: int
    topk: int
    tp_rank: int
    cp_rank: int
    pp_rank: int
    degenerate_routes: str
    device: torch.device
    metrics_groups: Sequence[Any]


class TracedPass(Protocol):
    """What the tracer reads of one phase's pass (a ``r3bridge.megatron.ReplayPass`` a ``PhaseRunner`` serves)."""

    phase: Phase
    plan: PhasePlan
    result: Any
    uids: dict[int, Any]

    @property
    def replayer(self) -> TracedReplayer: ...

    def installed_sample_ids(self, index: int) -> Optional[list[Optional[int]]]: ...

__all__ = ["PassTrace", "RunTracer"]


class PassTrace:
    """What the routers of one driver pass routed, per micro-batch and layer, on the device."""

    def __init__(self, replayer: TracedReplayer, action: Action) -> None:
        self.action = action
        self.dtype = route_dtype(replayer.num_experts)
        self.meta: dict[int, InstalledMicroBatch] = {}                 # micro-batch index -> chunk 0's install
        self.native: dict[int, dict[int, torch.Tensor]] = {}
        self.replayed: dict[int, dict[int, torch.Tensor]] = {}
        self.valid: dict[int, torch.Tensor] = {}
        # one rank per data-parallel group keeps what the framework handed over: every rank of the
        # group was handed the same samples with every MoE layer
        self.keeps_handed = replayer.tp_rank == 0 and replayer.cp_rank == 0 and replayer.pp_rank == 0
        self.degenerate = replayer.degenerate_routes
        self.handed: dict[int, ReplayBatch] = {}                       # micro-batch index -> its samples' routes

    def handed_routes(self, mb: InstalledMicroBatch, routes: Any) -> None:
        """The routes of micro-batch ``mb`` as the framework handed them over (a ``HandedRoutes``),
        read by the reader's own rules (``degenerate_routes``), once per micro-batch."""
        if self.keeps_handed and mb.index not in self.handed:
            self.handed[mb.index] = routes.to_batch(degenerate=self.degenerate)

    def routed(self, mb: InstalledMicroBatch, layer: int, native: torch.Tensor, replayed: Optional[torch.Tensor],
               valid: Optional[torch.Tensor]) -> None:
        """One router call of a forward (never a recompute): ``native`` / ``replayed`` ``[rows, K]``;
        ``valid``: rows that had a route. Compact copies, no host sync."""
        self.meta.setdefault(mb.index, mb)
        self.native.setdefault(mb.index, {})[layer] = native.detach().to(self.dtype)
        if replayed is not None:
            self.replayed.setdefault(mb.index, {})[layer] = replayed.detach().to(self.dtype)
            self.valid[mb.index] = valid if valid is not None else torch.ones(native.shape[0], dtype=torch.bool, device=native.device)


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dp_rank() -> int:
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return int(ps.get_data_parallel_rank())
    except Exception:  # noqa: BLE001 - no data-parallel group: one replica
        pass
    return 0


class RunTracer:
    """RL-step counting, the disk budget and the files of one policy model's traces."""

    def __init__(self, config: ReplayConfig, framework: str) -> None:
        assert config.trace_dir is not None
        self.root = Path(config.trace_dir)
        self.every = config.trace_every
        self.limit = config.trace_max_bytes
        self.framework = framework
        self.mode = config.replay_mode.value
        self.prefix = config.metrics_prefix
        self.step = 1                           # RL steps counted from 1, as the frameworks log them
        self._update_seen = False
        self._pass_counts: dict[str, int] = {}
        self._seq = 0
        self.bytes_written = 0
        self.stopped = False
        self.dropped_passes = 0

    # ------------------------------------------------------------------------------ per pass
    def begin(self, replayer: TracedReplayer, phase: Phase, action: Action) -> Optional[PassTrace]:
        """Called when a phase's driver pass opens; a :class:`PassTrace` when this pass is traced."""
        if phase is Phase.OLD_LOG_PROB and self._update_seen:
            self.step += 1
            self._update_seen = False
            self._pass_counts = {}
        if phase is Phase.UPDATE:
            self._update_seen = True
        name = phase.value
        self._pass_index = self._pass_counts.get(name, 0)
        self._pass_counts[name] = self._pass_index + 1
        if (self.step - 1) % self.every:
            return None
        if self.stopped:
            self.dropped_passes += 1
            return None
        return PassTrace(replayer, action)

    def finish(self, ps: TracedPass, trace: Optional[PassTrace], tag: str) -> None:
        """After the pass: write this rank's payloads and index line; add the trace metrics to
        the pass's result (``tag``: the phase's metrics tag, as :func:`r3bridge.metrics.tag_phase`)."""
        if trace is not None:
            self._write(ps, trace)
        res = ps.result
        if res is None:
            return
        extra = {f"{self.prefix}trace/bytes": float(self.bytes_written)}
        if self.stopped:
            extra[f"{self.prefix}trace/stopped"] = 1.0
            extra[f"{self.prefix}trace/dropped_passes"] = float(self.dropped_passes)
        res.metrics.update(extra)
        res.tagged.update(tag_phase(extra, self.prefix, tag))

    # ------------------------------------------------------------------------------ writing
    def _batches(self, ps: TracedPass, trace: PassTrace
                 ) -> tuple[list[dict], Optional[ReplayBatch], ReplayBatch, Optional[tuple[ReplayBatch, list[int]]]]:
        rep = ps.replayer
        idx = sorted(trace.meta)
        mbs = []
        for k in idx:
            mb = trace.meta[k]
            samples = ps.installed_sample_ids(k)
            samples = list(mb.sample_ids) if samples is None else samples
            mbs.append(micro_batch_entry(mb.seq_lens, samples, mb.rows, format=mb.pack.get("format", "thd"),
                                         cu_seqlens_padded=mb.pack.get("cu_seqlens_padded"),
                                         seq_length=mb.pack.get("seq_length"), uids=ps.uids.get(k)))
        args = (rep.layout, rep.tp_rank, rep.cp_rank, mbs)
        native = rank_batch(*args, [trace.native[k] for k in idx], [None] * len(idx), num_experts=rep.num_experts,
                            route_kind="native")
        replayed = None
        if trace.replayed:
            replayed = rank_batch(*args, [trace.replayed[k] for k in idx], [trace.valid[k] for k in idx],
                                  num_experts=rep.num_experts, route_kind=ps.plan.route_kind or "rollout")
        handed = None
        if trace.handed and all(k in trace.handed for k in idx):
            parts, samples = [], []
            for k, mb in zip(idx, mbs):
                keep = [i for i, s in enumerate(mb["sample_ids"]) if s is not None]    # padding sequences: no sample
                parts.append(trace.handed[k].select(keep))
                samples += [mb["sample_ids"][i] for i in keep]
            handed = (ReplayBatch.concat(parts), samples)
        return mbs, replayed, native, handed

    def _write(self, ps: TracedPass, trace: PassTrace) -> None:
        rep = ps.replayer
        rank, world = _world()
        payloads: dict[str, bytes] = {}
        if trace.meta:          # a pipeline stage without MoE layers routes nothing, yet takes part below
            mbs, replayed, native, handed = self._batches(ps, trace)
            payloads["native"] = native.to_bytes()
            if replayed is not None:
                payloads["replayed"] = replayed.to_bytes()
            if handed is not None:
                payloads["handed"] = handed[0].to_bytes()
        size = sum(len(b) for b in payloads.values())
        share = self.limit // world
        over = self.bytes_written + size > share
        if _any_rank(over, rep):
            self.stopped = True
            self.dropped_passes += 1
            self._append(rank, {"kind": "stopped", "rank": rank, "step": self.step, "phase": ps.phase.value,
                                "pass_index": self._pass_index, "bytes_written": self.bytes_written,
                                "pass_bytes": size, "limit": self.limit, "rank_share": share,
                                "reason": f"trace_max_bytes={self.limit} ({share} per rank of {world}) would be "
                                          f"exceeded: this pass and every later one are not written"})
            return
        if not payloads:
            return
        files = {}
        for view, data in payloads.items():
            name = payload_name(self.step, ps.phase.value, self._pass_index, rank, view)
            write_payload(self.root, name, data)
            files[view] = name
        self.bytes_written += size
        res = ps.result
        entry = {
            "kind": "pass", "step": self.step, "phase": ps.phase.value, "pass_index": self._pass_index,
            "seq": self._seq, "action": ps.plan.action.value, "route_kind": ps.plan.route_kind, "mode": self.mode,
            "framework": self.framework, "rank": rank, "world_size": world, "dp_rank": _dp_rank(),
            "tp_rank": rep.tp_rank, "cp_rank": rep.cp_rank, "pp_rank": rep.pp_rank,
            "layout": layout_to_json(rep.layout), "moe_layer_ids": list(rep.layout.moe_layer_ids),
            "layer_ids": list(native.layer_ids), "num_experts": rep.num_experts, "topk": rep.topk,
            "micro_batches": mbs, "files": files, "bytes": size,
            "handed_sample_ids": handed[1] if handed is not None else None,
            "metrics": {} if res is None else dict(res.metrics),
        }
        self._seq += 1
        self._append(rank, entry)

    def _append(self, rank: int, entry: dict[str, Any]) -> None:
        self.bytes_written += append_index(self.root, rank, entry)


def _any_rank(flag: bool, rep: TracedReplayer) -> bool:
    """``flag`` ORed over the model-parallel group (and CP): its ranks stop at the same pass."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not rep.metrics_groups:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=rep.device)
    for group in rep.metrics_groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
