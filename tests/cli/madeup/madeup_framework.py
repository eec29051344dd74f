"""madeup_framework: a made-up RL framework, standing in for a third-party package the adapter
``madeupfw`` is written against (it would be installed; here it sits at the project root).

What it does the way real frameworks do, and the ways that trip an adapter:

* its engine reports, per call, the routes of the **MoE layers only, keyed by 1-based layer
  number** (``{layer_number: [rows, K]}``; ``layer_number = index + 1``, Megatron's own
  convention), rows from the call's first prompt token, one fewer than prompt + output;
* a call the engine **aborted** reports ``routes=None`` (its partial output is kept and trained);
* a later turn re-sends the whole context; the framework keeps, per layer, the rows of earlier
  calls and appends only the rows past them (first seen wins, as verl's resuming client);
* its training batch is **left-padded**: ``tokens`` / ``mask`` ``[B, S]``, routes a per-sample
  list (``None`` for a sample without any), ``index`` ``[B]`` the dataset index;
* it splits batches with its own :func:`split` (an order applied, then contiguous parts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

LAYER_BASE = 1          # the framework numbers decoder layers from 1


@dataclass
class Completion:
    """One engine call: its prompt, its output, the routes of its MoE layers (``None``: aborted)."""

    prompt: list[int]
    output: list[int]
    routes: Optional[dict[int, np.ndarray]]


@dataclass
class Trajectory:
    tokens: list[int]                   # the whole trajectory the trainer sees
    completions: list[Completion]       # in call order


def accumulate_routes(completions: Sequence[Completion]) -> Optional[dict[int, np.ndarray]]:
    """The trajectory's routes: per layer, earlier calls' rows kept, later calls append the rows
    past them; ``None`` when no call reported routes."""
    out: Optional[dict[int, np.ndarray]] = None
    for c in completions:
        if c.routes is None:
            continue
        if out is None:
            out = {k: np.array(v) for k, v in c.routes.items()}
            continue
        for k, v in c.routes.items():
            have = out[k].shape[0]
            if v.shape[0] > have:
                out[k] = np.concatenate([out[k], v[have:]])
    return out


def collate(trajectories: Sequence[Trajectory], indices: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The training batch, left-padded to the longest trajectory."""
    b, s = len(trajectories), max(len(t.tokens) for t in trajectories)
    tokens = torch.zeros(b, s, dtype=torch.int64)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, t in enumerate(trajectories):
        tokens[i, s - len(t.tokens):] = torch.tensor(t.tokens)
        mask[i, s - len(t.tokens):] = True
    return {"tokens": tokens, "mask": mask, "routes": [accumulate_routes(t.completions) for t in trajectories],
            "index": torch.tensor(list(indices) if indices is not None else list(range(b)), dtype=torch.int64)}


def select(batch: dict[str, Any], idx: Sequence[int]) -> dict[str, Any]:
    """The samples ``idx`` of a batch, every field moved with them (tensors along dim 0, lists)."""
    ids = [int(i) for i in idx]
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[torch.tensor(ids, dtype=torch.long)]
        elif isinstance(v, list):
            out[k] = [v[i] for i in ids]
        else:
            out[k] = v
    return out


def split(batch: dict[str, Any], num_parts: int, order: Optional[Sequence[int]] = None
          ) -> list[tuple[dict[str, Any], list[int]]]:
    """The framework's mini-batching: ``order`` applied, then ``num_parts`` contiguous parts."""
    n = int(batch["tokens"].shape[0])
    idx = list(range(n)) if order is None else [int(i) for i in order]
    size = -(-n // num_parts)
    return [(select(batch, idx[lo:lo + size]), idx[lo:lo + size]) for lo in range(0, n, size)]
