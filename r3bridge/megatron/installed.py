"""The driver's record of one installed (chunk, micro-batch), and of a forward router call that a
recompute may pair with.

:class:`r3bridge.megatron.replay_pass.ReplayPass` creates them at ``install`` and in the forward; the
unrouted-row mask (``stats_mask.py``) reads which rows have a route, the R2 recorder
(``recorder.py``) reads the recorded ids. Plain records, so those modules depend on them and not
on the pass. Not the adapter's :class:`r3bridge.megatron.MicroBatch` (what an adapter installs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.targets import ShardedTargets


@dataclass
class InstalledMicroBatch:
    """One installed (chunk, micro-batch) of a replay pass."""

    chunk: int
    index: int
    rows: int                                   # router rows on this rank
    token_rows: int                             # of which real tokens (the rest is packing padding)
    seq_lens: list[int]
    pack: dict[str, Any]                        # format / cu_seqlens_padded / seq_length
    sample_ids: list[int]
    targets: Optional[ShardedTargets] = None    # REPLAY
    all_valid: bool = True
    batch_has_route: bool = True                # some row of the whole micro-batch (any rank) has a route
    fwd_left: set[int] = field(default_factory=set)     # layers not yet routed in the forward
    recompute_left: set[int] = field(default_factory=set)
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)  # RECORD: layer -> [rows, K]
    # record_weights: layer -> [rows, K] in the router's dtype, the final combine weights of the recorded ids
    recorded_weights: dict[int, torch.Tensor] = field(default_factory=dict)
    forwarded: bool = False
    routes: Optional[HandedRoutes] = None       # REPLAY: re-reads a target for a late recompute
    rank_rows: Optional[RankRows] = None        # REPLAY: the micro-batch's row map on this rank
    plan: Any = None                            # the PackPlan built at install (the loss's log-ratio reuses it)


@dataclass
class PendingRecompute:
    """A forward router call of a training pass that a recompute may pair with."""

    micro_batch: InstalledMicroBatch
    fingerprint: torch.Tensor                   # float32 [m] on the pass's device
    kept_target: bool                           # reentrant first pass: micro_batch.targets keeps the layer
