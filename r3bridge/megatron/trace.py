"""Writing route traces (the ``r3bridge`` options ``trace_dir``, ``trace_every``, ``trace_max_bytes``).

One implementation for every adapter: :class:`r3bridge.megatron.PhaseRunner` owns a
:class:`RunTracer` when ``trace_dir`` is set, opens a :class:`StepTrace` on the driver step of
each traced pass, and the step hands it, from inside the router hook, what each router call of a
forward routed: the router's own top-k (computed under replay anyway for the agreement metric)
and, in a replay pass, the replayed target. Everything stays on the device until the pass ends;
then each rank writes its own rows and layers (format: :mod:`r3bridge.trace`) and one index line.

Steps: the tracer counts RL steps itself: a compute_log_prob pass that follows an update starts
the next step (frameworks that run no compute_log_prob stay in step 0; their update passes are
numbered). Disk: each rank may write ``trace_max_bytes / world_size`` bytes; the pass that would
exceed it is not written, the rank writes a ``stopped`` index line, and every later pass counts
in the ``trace/dropped_passes`` metric. Ranks of one model-parallel group decide together (one
MAX all-reduce of a flag), so a pass is either written by all of them or by none.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from r3bridge.config import Action, Phase, ReplayConfig
from r3bridge.schema import ReplayBatch, route_dtype
from r3bridge.sharding import PackPlan, rank_positions
from r3bridge.trace import FORMAT_VERSION, index_name, layout_to_json, payload_name

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.megatron.phase import PhaseStep
    from r3bridge.megatron.replayer import Replayer
    from r3bridge.megatron.step import MicroBatch

__all__ = ["StepTrace", "RunTracer"]


class StepTrace:
    """What the routers of one driver step routed, per micro-batch and layer, on the device."""

    def __init__(self, replayer: "Replayer", action: Action) -> None:
        self.action = action
        self.dtype = route_dtype(replayer.num_experts)
        self.meta: dict[int, "MicroBatch"] = {}                 # micro-batch index -> chunk 0's install
        self.native: dict[int, dict[int, torch.Tensor]] = {}
        self.replayed: dict[int, dict[int, torch.Tensor]] = {}
        self.valid: dict[int, torch.Tensor] = {}

    def routed(self, mb: "MicroBatch", layer: int, native: torch.Tensor, replayed: Optional[torch.Tensor],
               valid: Optional[torch.Tensor]) -> None:
        """One router call of a forward (never a recompute): ``native`` / ``replayed`` ``[rows, K]``;
        ``valid``: rows that had a route. Compact copies, no host sync."""
        self.meta.setdefault(mb.index, mb)
        self.native.setdefault(mb.index, {})[layer] = native.detach().to(self.dtype)
        if replayed is not None:
            self.replayed.setdefault(mb.index, {})[layer] = replayed.detach().to(self.dtype)
            self.valid[mb.index] = valid if valid is not None else torch.ones(native.shape[0], dtype=torch.bool)


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
    """Step counting, the disk budget and the files of one policy model's traces."""

    def __init__(self, config: ReplayConfig, framework: str) -> None:
        assert config.trace_dir is not None
        self.root = Path(config.trace_dir)
        self.every = config.trace_every
        self.limit = config.trace_max_bytes
        self.framework = framework
        self.mode = config.replay_mode.value
        self.prefix = config.metrics_prefix
        self.step = 0
        self._update_seen = False
        self._pass_counts: dict[str, int] = {}
        self._seq = 0
        self.bytes_written = 0
        self.stopped = False
        self.dropped_passes = 0

    # ------------------------------------------------------------------------------ per pass
    def begin(self, replayer: "Replayer", phase: Phase, action: Action) -> Optional[StepTrace]:
        """Called when a phase's driver step opens; a :class:`StepTrace` when this pass is traced."""
        if phase is Phase.OLD_LOG_PROB and self._update_seen:
            self.step += 1
            self._update_seen = False
            self._pass_counts = {}
        if phase is Phase.UPDATE:
            self._update_seen = True
        name = phase.value
        self._pass_index = self._pass_counts.get(name, 0)
        self._pass_counts[name] = self._pass_index + 1
        if self.step % self.every:
            return None
        if self.stopped:
            self.dropped_passes += 1
            return None
        return StepTrace(replayer, action)

    def finish(self, ps: "PhaseStep", trace: Optional[StepTrace]) -> None:
        """After the pass: write this rank's payloads and index line; add the trace metrics to
        the pass's result."""
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
        from r3bridge.megatron.phase import phase_tag
        from r3bridge.metrics import tag_phase

        res.tagged.update(tag_phase(extra, self.prefix, phase_tag(ps.phase)))

    # ------------------------------------------------------------------------------ writing
    def _batches(self, ps: "PhaseStep", trace: StepTrace) -> tuple[list[dict], Optional[ReplayBatch], ReplayBatch]:
        rep = ps.runner.replayer
        idx = sorted(trace.meta)
        layers = sorted({lid for k in idx for lid in trace.native[k]})
        mbs, nat_parts, rep_parts, nat_valid, rep_valid = [], [], [], [], []
        for k in idx:
            mb = trace.meta[k]
            plan = PackPlan.build(rep.layout, mb.seq_lens, **mb.pack)
            seq, pos = rank_positions(plan, rep.layout, rep.tp_rank, rep.cp_rank)
            real = pos < plan.seq_lens[seq]         # packing padding rows are no token
            nat_parts.append(torch.stack([trace.native[k][lid] for lid in layers], 1).cpu())
            nat_valid.append(real)
            if trace.replayed:
                rep_parts.append(torch.stack([trace.replayed[k][lid] for lid in layers], 1).cpu())
                rep_valid.append(trace.valid[k].cpu() & real)
            cu = mb.pack.get("cu_seqlens_padded")
            samples = ps._ids[k][0] if k in ps._ids else list(mb.sample_ids)
            mbs.append({"seq_lens": list(mb.seq_lens), "sample_ids": samples, "rows": mb.rows,
                        "format": mb.pack.get("format", "thd"),
                        "cu_seqlens_padded": None if cu is None else [int(x) for x in (cu.tolist() if
                                                                          isinstance(cu, torch.Tensor) else cu)],
                        "seq_length": mb.pack.get("seq_length")})
        rows = [m["rows"] for m in mbs]
        E = rep.num_experts
        native = ReplayBatch.from_trusted(torch.cat(nat_parts), rows, [0] * len(rows), torch.cat(nat_valid),
                                          tuple(layers), E, "native")
        replayed = None
        if rep_parts:
            replayed = ReplayBatch.from_trusted(torch.cat(rep_parts), rows, [0] * len(rows), torch.cat(rep_valid),
                                                tuple(layers), E, ps.plan.source or "rollout")
        return mbs, replayed, native

    def _write(self, ps: "PhaseStep", trace: StepTrace) -> None:
        rep = ps.runner.replayer
        rank, world = _world()
        if not trace.meta:
            return
        mbs, replayed, native = self._batches(ps, trace)
        payloads = {"native": native.to_bytes()}
        if replayed is not None:
            payloads["replayed"] = replayed.to_bytes()
        size = sum(len(b) for b in payloads.values())
        share = self.limit // world
        over = self.bytes_written + size > share
        if _any_rank(over, rep):
            self.stopped = True
            self.dropped_passes += 1
            self._append(rank, {"kind": "stopped", "rank": rank, "step": self.step, "pass": ps.phase.value,
                                "pass_index": self._pass_index, "bytes_written": self.bytes_written,
                                "pass_bytes": size, "limit": self.limit, "rank_share": share,
                                "reason": f"trace_max_bytes={self.limit} ({share} per rank of {world}) would be "
                                          f"exceeded: this pass and every later one are not written"})
            return
        files = {}
        for view, data in payloads.items():
            name = payload_name(self.step, ps.phase.value, self._pass_index, rank, view)
            _write_atomic(self.root / name, data)
            files[view] = name
        self.bytes_written += size
        res = ps.result
        entry = {
            "kind": "pass", "step": self.step, "pass": ps.phase.value, "pass_index": self._pass_index,
            "seq": self._seq, "action": ps.plan.action.value, "source": ps.plan.source, "mode": self.mode,
            "framework": self.framework, "rank": rank, "world_size": world, "dp_rank": _dp_rank(),
            "tp_rank": rep.tp_rank, "cp_rank": rep.cp_rank, "pp_rank": rep.pp_rank,
            "layout": layout_to_json(rep.layout), "moe_layer_ids": list(rep.layout.moe_layer_ids),
            "layer_ids": list(native.layer_ids), "num_experts": rep.num_experts, "topk": rep.topk,
            "micro_batches": mbs, "files": files, "bytes": size,
            "metrics": {} if res is None else dict(res.metrics),
        }
        self._seq += 1
        self._append(rank, entry)

    def _append(self, rank: int, entry: dict[str, Any]) -> None:
        entry = {"version": FORMAT_VERSION, **entry}
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps(entry, allow_nan=True) + "\n"
        with open(self.root / index_name(rank), "a") as f:       # one write per line: no torn line
            f.write(line)
        self.bytes_written += len(line)


def _any_rank(flag: bool, rep: "Replayer") -> bool:
    """``flag`` ORed over the model-parallel group (and CP): its ranks stop at the same pass."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not rep.metrics_groups:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=rep.device)
    for group in rep.metrics_groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
