"""The on-disk format of a route trace: folder and file names, the index lines, the payloads.

A trace is a folder written by the Megatron driver when the ``r3bridge`` section sets
``trace_dir`` (writer: :mod:`r3bridge.trace.writing`). Each rank writes only what its routers
routed (its layers, its token rows, in router order) and never touches another rank's files:

* ``index.rank<NNNNN>.jsonl``: one JSON object per line, ``kind`` ``"pass"`` (one traced schedule
  run: the RL step (from 1), the pass's ``phase`` and its index among that phase's passes of the
  step, action, ``route_kind``, the rank's coordinates, the layout, the framework, the model's MoE
  layer ids, every micro-batch's packing and sample ids, the files, the driver's metrics of that
  pass) or ``"stopped"`` (the rank's share of ``trace_max_bytes`` is spent: nothing more was
  written, and why);
* ``step<SSSSSS>/<phase>.<index>/rank<NNNNN>.<view>.r3b``: ``ReplayBatch.to_bytes()`` payloads
  (CRC-checked). Views ``native`` (the router's own top-k under replay; valid on real-token rows)
  and, in a replay pass, ``replayed`` (the routes dispatched where valid: rollout or recorded):
  "sequences" are the pass's micro-batches, rows the rank's router rows. View ``handed`` (a replay
  pass, one rank per data-parallel group): the routes as the framework handed them over, one
  sequence per sample (``handed_sample_ids`` in the index line), rows by token from each sample's
  start row, every MoE layer: what the routers should have dispatched.

Samples are named by :func:`token_uid` (their tokens) where the adapter passes names.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.errors import PayloadError
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, rank_positions

__all__ = ["TraceError", "FORMAT_VERSION", "VIEWS", "index_name", "payload_name", "layout_to_json",
           "layout_from_json", "micro_batch_entry", "rank_batch", "write_payload", "append_index", "token_uid"]

# 2: the index keys "phase" and "route_kind" (were "pass" and "source"), steps from 1, the handed view
FORMAT_VERSION = 2
VIEWS = ("replayed", "native", "dispatched", "handed")


class TraceError(PayloadError):
    """A trace folder, index or payload file is missing, truncated, corrupted or inconsistent
    (the message names the file)."""


def index_name(rank: int) -> str:
    return f"index.rank{rank:05d}.jsonl"


def payload_name(step: int, phase: str, pass_index: int, rank: int, view: str) -> str:
    return f"step{step:06d}/{phase}.{pass_index}/rank{rank:05d}.{view}.r3b"


def layout_to_json(layout: ParallelLayout) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(layout):
        if f.name.startswith("_"):
            continue
        v = getattr(layout, f.name)
        if f.name == "pipeline_model_parallel_layout" and v is not None:
            v = layout._stages                      # the parsed stage list: plain names
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def layout_from_json(d: dict[str, Any]) -> ParallelLayout:
    return ParallelLayout(**d)


def micro_batch_entry(seq_lens: Sequence[int], sample_ids: Sequence[Optional[int]], rows: int, *, format: str = "thd",
                      cu_seqlens_padded: Any = None, seq_length: Optional[int] = None,
                      uids: Optional[Sequence[Optional[str]]] = None) -> dict[str, Any]:
    """A micro-batch as the index records it: the packing :func:`r3bridge.parallel.unsharding.unshard` needs to
    place each router row, the sample of each sequence (``None``: a padding sequence) and, when the
    adapter passes them, the framework's own sample names (``uids``)."""
    cu = cu_seqlens_padded
    if isinstance(cu, torch.Tensor):
        cu = cu.tolist()
    return {"seq_lens": [int(x) for x in seq_lens], "sample_ids": [None if s is None else int(s) for s in sample_ids],
            "rows": int(rows), "format": format, "cu_seqlens_padded": None if cu is None else [int(x) for x in cu],
            "seq_length": None if seq_length is None else int(seq_length),
            "uids": None if uids is None else [None if u is None else str(u) for u in uids]}


def rank_batch(layout: ParallelLayout, tp_rank: int, cp_rank: int, micro_batches: Sequence[dict[str, Any]],
               ids: Sequence[dict[int, torch.Tensor]], valid: Sequence[Optional[torch.Tensor]], *, num_experts: int,
               route_kind: str = "rollout") -> ReplayBatch:
    """One rank's rows of one pass as a payload: sequence ``k`` = micro-batch ``k``'s router rows
    (``ids[k][layer]`` ``[rows, K]``), start row 0. A row is valid where it is a real token (packing
    padding never is) and, with ``valid[k]`` given, where that mask holds (rows that had a route).
    ``route_kind``: ``"native"`` (the router's own top-k) or the pass's (``"rollout"`` /
    ``"recorded"``)."""
    layers = sorted({lid for per in ids for lid in per})
    dtype = route_dtype(num_experts)
    parts, masks = [], []
    for mb, per, v in zip(micro_batches, ids, valid):
        plan = PackPlan.build(layout, mb["seq_lens"], format=mb["format"], cu_seqlens_padded=mb["cu_seqlens_padded"],
                              seq_length=mb["seq_length"])
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        real = pos < plan.seq_lens[seq]
        parts.append(torch.stack([per[lid].to(dtype).cpu() for lid in layers], 1) if layers else
                     torch.zeros((int(seq.numel()), 0, 1), dtype=dtype))
        masks.append(real if v is None else v.cpu() & real)
    rows = [int(m["rows"]) for m in micro_batches]
    return ReplayBatch.from_trusted(torch.cat(parts), rows, [0] * len(rows), torch.cat(masks), tuple(layers),
                                    num_experts, route_kind)


def write_payload(root: Path, name: str, data: bytes) -> None:
    """Write one payload file whole (a temporary file renamed: a reader never sees half of it)."""
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def append_index(root: Path, rank: int, entry: dict[str, Any]) -> int:
    """Append one line to the rank's index (one write call per line); returns its size in bytes."""
    root.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"version": FORMAT_VERSION, **entry}, allow_nan=True) + "\n"
    with open(root / index_name(rank), "a") as f:
        f.write(line)
    return len(line.encode())


def token_uid(tokens: Any) -> str:
    """A sample's name from its tokens (``"<length>:<crc32>"``): the same in every pass of a step
    and in every run that trains the same trajectory, whatever a framework numbers, shuffles or
    re-partitions. Adapters pass it as :attr:`r3bridge.megatron.MicroBatch.uids` when tracing, so
    ``r3bridge diff`` pairs samples by it."""
    arr = np.ascontiguousarray(torch.as_tensor(tokens).detach().cpu().to(torch.int64).numpy(), dtype="<i8")
    return f"{arr.size}:{zlib.crc32(arr.tobytes()):08x}"
