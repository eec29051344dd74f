"""``token_owners``: the inverse of ``rank_positions`` over all ranks (the R2 gather's one plan)."""
from __future__ import annotations

import pytest
import torch

from r3bridge import ParallelLayout
from r3bridge.errors import ReplayError
from r3bridge.parallel.packing import PackPlan, rank_positions, token_owners


@pytest.mark.parametrize("tp,cp,sp,fmt", [(1, 1, False, "thd"), (2, 1, True, "thd"), (2, 1, False, "thd"),
                                          (1, 2, False, "thd"), (2, 2, True, "thd"), (4, 1, True, "thd"),
                                          (2, 2, True, "bshd"), (1, 2, False, "bshd")])
def test_every_token_maps_back_to_its_rank_row(tp, cp, sp, fmt):
    layout = ParallelLayout(num_layers=2, moe_layer_freq=1, tp=tp, cp=cp, sequence_parallel=sp)
    lens = [13, 1, 7, 24]
    kw = dict(seq_length=32) if fmt == "bshd" else {}
    plan = PackPlan.build(layout, lens, format=fmt, **kw)
    tp_n = tp if sp else 1
    rank, row = token_owners(plan, layout, tp_n)
    assert rank.numel() == sum(lens)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos_of = torch.cat([torch.arange(n) for n in lens])
    seen = set()
    for t in range(sum(lens)):
        r, j = int(rank[t]), int(row[t])
        seq, pos = rank_positions(plan, layout, r % tp_n, r // tp_n)
        assert (int(seq[j]), int(pos[j])) == (int(seq_of[t]), int(pos_of[t]))
        seen.add((r, j))
    assert len(seen) == sum(lens)                      # no two tokens share a (rank, row)


def test_sp_off_uses_tp_rank_0_and_refuses_a_missing_rank():
    layout = ParallelLayout(num_layers=2, moe_layer_freq=1, tp=2, sequence_parallel=True)
    plan = PackPlan.build(layout, [6, 4])
    with pytest.raises(ReplayError, match="on no rank"):
        token_owners(plan, layout, 1)                   # half the rows live on TP rank 1
