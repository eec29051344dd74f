"""Hypothesis strategies shared by the core tests: parallel layouts and ragged batches."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import r3bridge
from r3bridge import ParallelLayout

from ._reference import tag_routes

EXPERTS_TOPK = [(4, 1), (8, 2), (64, 8), (128, 1), (300, 4), (40000, 2)]


@st.composite
def layouts(draw, *, max_pp: int = 4, allow_fp8: bool = False) -> ParallelLayout:
    """tp, cp in {1,2,4}; pp in {1,2,4} (<= max_pp); optional vpp=2; even, uneven first/last
    or embedding/loss-accounted stages; int freq (incl. > 1), dense-first or random 0/1 lists."""
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if p <= max_pp]))
    sp = None if tp == 1 else draw(st.sampled_from([None, True, False]))
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    vp = vpp or 1
    kind = draw(st.sampled_from(["even", "uneven", "embloss"])) if pp > 1 else "even"
    kw: dict = {}
    if kind == "uneven":
        first = draw(st.sampled_from([None, 1, 2]))
        last = draw(st.sampled_from([None, 1, 3] if first is not None else [1, 3]))
        mid_stages = pp - (first is not None) - (last is not None)
        m = draw(st.integers(1, 2)) if mid_stages else 0
        num_layers = ((first or 0) + (last or 0) + mid_stages * m) * vp
        kw.update(num_layers_in_first_pipeline_stage=None if first is None else first * vp,
                  num_layers_in_last_pipeline_stage=None if last is None else last * vp)
    elif kind == "embloss":
        emb, loss = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
        per_chunk = draw(st.integers(1, 2))
        if pp * vp * per_chunk - emb - loss < 1:
            per_chunk = 2
        num_layers = pp * vp * per_chunk - emb - loss
        kw.update(account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    else:
        num_layers = pp * vp * draw(st.integers(1, 2))
    fk = draw(st.sampled_from(["all", "int", "dense_first", "random"]))
    if fk == "all":
        freq = 1
    elif fk == "int":
        freq = draw(st.integers(2, 3))
    elif fk == "dense_first":
        k = draw(st.integers(1, max(1, num_layers - 1)))
        freq = [0] * min(k, num_layers - 1) + [1] * (num_layers - min(k, num_layers - 1))
    else:
        freq = draw(st.lists(st.integers(0, 1), min_size=num_layers, max_size=num_layers))
        if not any(freq):
            freq[-1] = 1
    # FP8 pads the whole micro-batch to align*128 rows: keep it to small tp*cp so the
    # per-token Python reference stays fast.
    fp8 = allow_fp8 and tp * cp <= 4 and draw(st.booleans())
    return ParallelLayout(num_layers, freq, tp=tp, cp=cp, pp=pp, vpp=vpp, sequence_parallel=sp,
                          fp8=fp8, **kw)


@dataclass
class Batch:
    rb: r3bridge.ReplayBatch
    seq_lens: list[int]
    starts: list[int]
    rows: list[int]
    invalid: set            # {(seq, token position)} marked invalid
    num_experts: int
    topk: int


@st.composite
def batches(draw, layer_ids, *, max_seqs: int = 4, max_len: int = 40, experts_topk=None) -> Batch:
    """Ragged batch of tag routes: random lengths, start rows (multi-turn offsets), last row
    present or not, random invalid rows, various (E, K)."""
    E, K = draw(st.sampled_from(experts_topk or EXPERTS_TOPK))
    n = draw(st.integers(1, max_seqs))
    seq_lens, starts, rows, arrays, valids = [], [], [], [], []
    invalid = set()
    for i in range(n):
        L = draw(st.integers(1, max_len))
        s = draw(st.sampled_from([0, 0, min(3, L - 1), L - 1]))
        end = draw(st.sampled_from([L, L - 1])) if L - 1 >= s else L
        r = end - s
        a = tag_routes(i, s, r, layer_ids, K, E)
        v = np.ones(r, dtype=bool)
        holes = draw(st.sets(st.integers(0, r - 1), max_size=3)) if r else set()
        for j in holes:
            v[j] = False
            a[j] = 0            # engines send zero rows where there is no route
            invalid.add((i, s + j))
        seq_lens.append(L)
        starts.append(s)
        rows.append(r)
        arrays.append(a)
        valids.append(v)
    rb = r3bridge.ReplayBatch.from_ragged(arrays, num_experts=E, layer_ids=list(layer_ids),
                                          start_rows=starts, valid=valids)
    return Batch(rb, seq_lens, starts, rows, invalid, E, K)
