"""``assemble_gathered``: the R2 gather's one-pass read of every rank's recorded ids, checked
against ``shard`` (the rank distribution) on every layout axis, both copy methods."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from r3bridge import ParallelLayout, ReplayBatch, shard
from r3bridge.errors import ReplayError
from r3bridge.parallel.packing import PackPlan
from r3bridge.parallel.unsharding import assemble_gathered

from ._reference import random_routes

LAYOUTS = {
    "plain": dict(num_layers=4),
    "tp2_sp": dict(num_layers=4, tp=2),
    "tp2_no_sp": dict(num_layers=4, tp=2, sequence_parallel=False),
    "cp2": dict(num_layers=4, cp=2),
    "tp2_cp2": dict(num_layers=4, tp=2, cp=2),
    "pp2_dense_first": dict(num_layers=6, moe_layer_freq=[0, 1, 1, 0, 1, 1], pp=2),
    "pp2_vpp2": dict(num_layers=8, pp=2, vpp=2),
    "pp4_uneven": dict(num_layers=6, pp=4, num_layers_in_first_pipeline_stage=1,
                       num_layers_in_last_pipeline_stage=1, moe_layer_freq=[0, 1, 1, 1, 1, 1]),
}
MB_LENS = [[13, 4, 9], [7], [5, 11]]
E, K = 300, 3           # int16 ids: a (row, layer) is 6 bytes, not a machine word


def _rank_parts(layout, batches, plans):
    """What each rank contributes: [micro-batch][rows][its chunks' MoE layers][K], padded."""
    tp_n = layout.tp if layout.sequence_parallel else 1
    parts = {}
    for p in range(layout.pp):
        for cr in range(layout.cp):
            for tr in range(tp_n):
                ids = []
                for rb, plan in zip(batches, plans):
                    per_layer = []
                    for v in range(layout.vp_size):
                        t = shard(rb, layout, plan.seq_lens.tolist(), tp_rank=tr, cp_rank=cr, pp_rank=p, vp_stage=v)
                        per_layer += [t.indices[lid].to(rb.routes.dtype) for lid in t.layer_ids]
                    if per_layer:                      # token-major: [rows, layers, K]
                        ids.append(torch.stack(per_layer, 1).reshape(-1))
                parts[(p, cr, tr)] = torch.cat(ids) if ids else torch.zeros(0, dtype=batches[0].routes.dtype)
    longest = max(x.numel() for x in parts.values())
    flat = [torch.cat([x, torch.full((longest - x.numel(),), 7, dtype=x.dtype)]) for _, x in sorted(parts.items())]
    return torch.cat(flat)


@pytest.mark.parametrize("method", ["runs", "index", "auto"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_matches_the_rank_distribution(name, method):
    layout = ParallelLayout(**LAYOUTS[name])
    rng = np.random.default_rng(5)
    lids = layout.moe_layer_ids
    batches, plans = [], []
    for lens in MB_LENS:
        batches.append(ReplayBatch.from_ragged([random_routes(rng, n, len(lids), K, E) for n in lens],
                                               num_experts=E, layer_ids=lids))
        plans.append(PackPlan.build(layout, lens))
    flat = _rank_parts(layout, batches, plans)
    sample_ids = [5, 0, 3, 1, 4, 2]                    # micro-batches were re-partitioned
    got = assemble_gathered(flat, layout, plans, sample_ids, num_experts=E, topk=K, method=method)
    want = ReplayBatch.concat(batches).select(np.argsort(sample_ids).tolist())
    assert got.equals(want)
    assert got.route_kind == "recorded" and bool(got.valid.all())


def test_refuses_a_buffer_that_does_not_fit():
    layout = ParallelLayout(num_layers=2, pp=2)
    plan = PackPlan.build(layout, [4, 4])
    with pytest.raises(ReplayError, match="need"):
        assemble_gathered(torch.zeros(2 * 3 * 2, dtype=torch.uint8), layout, [plan], [0, 1], num_experts=8, topk=2)
    with pytest.raises(ReplayError, match="duplicate sample_ids"):
        assemble_gathered(torch.zeros(2 * 8 * 2, dtype=torch.uint8), layout, [plan], [0, 0], num_experts=8, topk=2)
