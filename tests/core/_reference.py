"""Independent references for the core tests.

Everything here is deliberately written in the simplest per-sequence / per-token Python loops
(never vectorised, never calling r3bridge's own packing code) so that a shared mistake between
the implementation and its check is unlikely. Performance does not matter here.
"""
from __future__ import annotations

import contextlib
import math
from typing import Sequence
from unittest import mock

import numpy as np


# ------------------------------------------------------------------------------ random batches
def random_routes(rng: np.random.Generator, rows: int, num_layers: int, topk: int,
                  num_experts: int, dtype=np.int64) -> np.ndarray:
    """``[rows, L, K]`` routes with distinct ids per (row, layer), drawn uniformly."""
    keys = rng.random((rows, num_layers, num_experts))
    return np.argsort(keys, axis=-1)[..., :topk].astype(dtype)


def tag_route(seq: int, pos: int, layer: int, topk: int, num_experts: int) -> list[int]:
    """The route a token *names*: ids ``(tag * K + k) mod E`` with ``tag`` a hash of
    (sequence, position, layer). K consecutive residues mod E are distinct (K <= E), so every
    row is a valid route; with many experts every token's route differs, so a misplaced row
    is visible."""
    tag = (seq * 1000003 + pos * 131 + layer * 7) % num_experts
    return [(tag * topk + k) % num_experts for k in range(topk)]


def tag_routes(seq: int, start: int, rows: int, layer_ids: Sequence[int], topk: int,
               num_experts: int) -> np.ndarray:
    """``[rows, L, K]``: row j is the tag route of token ``start + j`` of sequence ``seq``."""
    out = np.zeros((rows, len(layer_ids), topk), dtype=np.int64)
    for j in range(rows):
        for li, lid in enumerate(layer_ids):
            out[j, li] = tag_route(seq, start + j, lid, topk, num_experts)
    return out


# ------------------------------------------------------------------------------ packing reference
def reference_padded_lens(seq_lens: Sequence[int], tp: int, cp: int, fp8: bool = False) -> list[int]:
    """verl/SkyRL THD alignment, written out: pad each sequence to ``tp*cp*2`` (cp > 1) or ``tp``;
    FP8: ``lcm(16, align)`` per sequence and the total to ``align * 128`` (added to the last)."""
    align = tp * cp * 2 if cp > 1 else tp
    per_seq = math.lcm(16, align) if fp8 else align
    padded = []
    for n in seq_lens:
        p = n
        while p % per_seq:
            p += 1
        padded.append(p)
    if fp8 and padded:
        total = sum(padded)
        while total % (align * 128):
            total += 1
            padded[-1] += 1
    return padded


def reference_rank_tags(seq_lens: Sequence[int], *, tp: int, cp: int, sp: bool, tp_rank: int,
                        cp_rank: int, padded: Sequence[int] | None = None, fp8: bool = False
                        ) -> list[tuple[int, int]]:
    """(sequence, position) of every router row of rank (tp_rank, cp_rank), THD.

    Tag each token with (sequence, position), pack the tags like input_ids: pad each sequence,
    zigzag *per sequence* (chunks r and 2cp-1-r of 2cp), concatenate, then split contiguously
    over TP when SP is on. Positions >= seq_len are padding.
    """
    if padded is None:
        padded = reference_padded_lens(seq_lens, tp, cp, fp8)
    local: list[tuple[int, int]] = []
    for i, plen in enumerate(padded):
        tags = [(i, p) for p in range(plen)]
        if cp > 1:
            c = plen // (2 * cp)
            chunks = [tags[j * c:(j + 1) * c] for j in range(2 * cp)]
            local += chunks[cp_rank] + chunks[2 * cp - 1 - cp_rank]
        else:
            local += tags
    if sp:
        n = len(local) // tp
        local = local[tp_rank * n:(tp_rank + 1) * n]
    return local


def reference_bshd_tags(batch: int, seq_length: int, *, tp: int, cp: int, sp: bool, tp_rank: int,
                        cp_rank: int) -> list[tuple[int, int]]:
    """BSHD: zigzag over the whole sequence dim, SP split of that dim, rows s-major."""
    positions = list(range(seq_length))
    if cp > 1:
        c = seq_length // (2 * cp)
        chunks = [positions[j * c:(j + 1) * c] for j in range(2 * cp)]
        positions = chunks[cp_rank] + chunks[2 * cp - 1 - cp_rank]
    if sp:
        n = len(positions) // tp
        positions = positions[tp_rank * n:(tp_rank + 1) * n]
    rows = []
    for p in positions:
        for b in range(batch):
            rows.append((b, p))
    return rows


def expected_from_tags(tags, *, starts, rows, invalid, seq_lens, layer_ids, topk, num_experts):
    """Expected (indices per layer [T, K], valid [T]) of a rank whose rows hold ``tags``.

    A row has a route iff its position is a real token (< seq_len), inside the sequence's
    covered range ``[start, start + rows)`` and not marked invalid; its route is then the tag
    route of (sequence, position, layer), recomputed from the tag. Otherwise the filler
    ``0..K-1`` and valid False.
    """
    T = len(tags)
    valid = np.zeros(T, dtype=bool)
    out = {lid: np.zeros((T, topk), dtype=np.int64) for lid in layer_ids}
    for r, (i, p) in enumerate(tags):
        ok = p < seq_lens[i] and starts[i] <= p < starts[i] + rows[i] and (i, p) not in invalid
        valid[r] = ok
        for lid in layer_ids:
            out[lid][r] = tag_route(i, p, lid, topk, num_experts) if ok else list(range(topk))
    return out, valid


# ------------------------------------------------------------------------------ megatron / verl
class FakeGroup:
    """Process-group stand-in exposing only what megatron's split functions read."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@contextlib.contextmanager
def megatron_parallel_state(*, tp: int = 1, cp: int = 1, cp_rank: int = 0, pp_rank: int = 0,
                            vpp: int | None = None):
    """Answer megatron's parallel_state queries (read by megatron-core and verl) without a
    process group: only the getters these tests' callees read are patched."""
    from megatron.core import parallel_state as ps

    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(ps, "get_tensor_model_parallel_world_size", return_value=tp))
        st.enter_context(mock.patch.object(ps, "get_context_parallel_world_size", return_value=cp))
        st.enter_context(mock.patch.object(ps, "get_context_parallel_rank", return_value=cp_rank))
        st.enter_context(mock.patch.object(ps, "get_pipeline_model_parallel_rank", return_value=pp_rank))
        st.enter_context(mock.patch.object(ps, "get_virtual_pipeline_model_parallel_world_size",
                                           return_value=vpp))
        yield ps


def megatron_sp_scatter(x, tp: int, tp_rank: int):
    """megatron-core's own ``scatter_to_sequence_parallel_region`` (the SP split of the
    embedding output), run with a fake TP group. Its group lookup returns None when torch
    distributed is not initialised, so only that lookup is bypassed."""
    from megatron.core.tensor_parallel import mappings

    with mock.patch.object(mappings, "get_tensor_model_parallel_group_if_none", lambda g, **kw: g):
        return mappings.scatter_to_sequence_parallel_region(x, group=FakeGroup(tp, tp_rank))
