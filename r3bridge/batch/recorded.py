"""R2's recorded routes on their way back into a framework's batch.

After the compute_log_prob pass, :meth:`r3bridge.session.AdapterSession.recorded_for` holds the
trainer's own routes, one sequence per sample in sample order, on every rank. A framework moves
them with its samples in its own format (the adapter's codec writes that); what is not the
framework's is here: per-sample payloads for frameworks that hand results around per sample
(a worker's per-sample outputs), one batch back from them, built once, and the recording cut
into the framework's parts (a list of batch dicts).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import ReplayStateError

__all__ = ["per_sample_payloads", "from_payloads", "split_sizes"]


def per_sample_payloads(recorded: ReplayBatch) -> list[bytes]:
    """One wire payload per sample (``ReplayBatch.to_bytes`` of its rows: views, one copy each)."""
    return [recorded.select_range(i, i + 1).to_bytes() for i in range(recorded.num_seqs)]


def from_payloads(payloads: Sequence[bytes]) -> ReplayBatch:
    """Per-sample R2 payloads (batch order) -> one recorded batch, built once. The ids are the
    routers' own top-k (distinct, in range by construction) and each payload's CRCs guard the
    transport, so they are not validated here: the update's read (the one reader) checks every id
    it reads, once."""
    from r3bridge.batch import wire

    parts = [wire.decode(bytes(p)) for p in payloads]
    if not parts:
        raise ReplayStateError("R2: the policy forward returned no recorded routes")
    first = parts[0]
    for j, d in enumerate(parts[1:], 1):
        if (d.layer_ids, d.num_experts, tuple(d.routes.shape[1:])) != (first.layer_ids, first.num_experts,
                                                                       tuple(first.routes.shape[1:])):
            raise ReplayStateError(f"R2 payload of sample {j} has another schema than sample 0's")
    routes = torch.cat([d.routes for d in parts]) if len(parts) > 1 else first.routes
    valid = torch.cat([d.valid for d in parts]) if len(parts) > 1 else first.valid
    return ReplayBatch.from_trusted(routes, [r for d in parts for r in d.rows_per_seq],
                                    [s for d in parts for s in d.start_rows], valid, tuple(first.layer_ids),
                                    first.num_experts, "recorded")


def split_sizes(recorded: ReplayBatch, sizes: Sequence[int]) -> list[ReplayBatch]:
    """The recording cut into consecutive parts of ``sizes`` samples (views: no copy)."""
    if sum(sizes) != recorded.num_seqs:
        raise ReplayStateError(f"{recorded.num_seqs} recorded samples for parts of {list(sizes)}")
    bounds = [0, *itertools.accumulate(int(n) for n in sizes)]
    return [recorded.select_range(a, b) for a, b in zip(bounds, bounds[1:])]
