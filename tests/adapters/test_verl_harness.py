"""The adapter's engine on a real megatron-core model (CPU Megatron harness, 2 gloo ranks).

Everything of the adapter runs for real: ``forward_backward_batch`` opens the driver step,
``forward_step`` installs each (chunk, micro-batch)'s targets from the micro-batch's
``routed_experts`` (verl's transport: every decoder layer, dense layer zero, zero last and invalid
rows) with verl's own ``preprocess_thd_engine`` packing, R2 returns the recorded routes in verl's
layout and replays them. Only verl's model-running ``forward_step`` body and its schedule are
stood in for by the harness (``HarnessVerl``): no verl model / bridge / TE is needed.
The routes each router actually dispatched are checked with the harness's own packing reference.
"""
from __future__ import annotations

import re
import sys
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import verl  # noqa: E402,F401
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402

from r3bridge import ReplayBatch  # noqa: E402
from r3bridge.adapters.verl.codec import ROUTES_KEY, handed_routes  # noqa: E402
from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine  # noqa: E402
from r3bridge.config import ReplayConfig  # noqa: E402
from r3bridge.testing.harness.data import align_for, make_packed_batch  # noqa: E402
from r3bridge.testing.harness.dist import Layout, spawn_layouts  # noqa: E402
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks  # noqa: E402
from r3bridge.testing.harness.probe import RoutingProbe  # noqa: E402
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule  # noqa: E402

# the driver grid's route builder and probe check (r3bridge's own test scenarios, tests/megatron)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
import replay_grid as grid  # noqa: E402

NUM_LAYERS = 4
HF = {"model_type": "deepseek_v3", "num_hidden_layers": NUM_LAYERS, "first_k_dense_replace": 1,
      "n_routed_experts": 4, "num_experts_per_tok": 2}
SPEC = ModelSpec(num_layers=NUM_LAYERS, moe_layer_freq=[0, 1, 1, 1])      # = HF: layer 0 dense
# every micro-batch packs to the same length with align 1 and 2 (fixed p2p shapes under PP)
SEQ_LENS = [[13, 7, 20], [9, 15, 16], [21, 5, 14]]
LAYOUTS = [Layout(tp=2), Layout(pp=2, vpp=2)]


class _Item(dict):
    """One verl micro-batch (its TensorDict fields) that the harness schedule can size."""

    def __init__(self, fields, packed):
        super().__init__(fields)
        self.packed, self.total = packed, packed.total


class HarnessVerl(MegatronEngineWithLMHead):
    """Stands in for verl's schedule and model forward: fixed micro-batches, harness forward."""

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        items, start = [], 0
        for packed in self.packed:
            idx = list(range(start, start + len(packed.seq_lens)))
            start += len(idx)
            mb = tu.index_select_tensor_dict(data, idx)
            items.append(_Item({k: mb[k] for k in mb.keys()}, packed))
        fs = partial(self.forward_step, logits_processor_func=None, postprocess_micro_batch_func=None)
        with RoutingProbe(self.module) as self.probe:
            run_schedule(self.module, items, fs, forward_only=forward_only)
        return {"model_output": {}, "metrics": {}} if self.ctx.is_last_stage else {}

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        item = next(batch_iter)
        return self.inner(iter([item.packed]), model)


class Engine(R3BridgeMegatronEngine, HarnessVerl):
    pass


def _verl_routes(routes, seq_lens):
    """Harness ReplayBatch (MoE layers, rows = n - 1) -> verl's nested int16 transport."""
    out = []
    for i, n in enumerate(seq_lens):
        r, v = routes.sequence(i)
        full = torch.zeros(n, NUM_LAYERS, routes.topk, dtype=torch.int16)
        for j, lid in enumerate(routes.layer_ids):
            full[: r.shape[0], lid] = r[:, j].to(torch.int16)
        full[: r.shape[0]][~v] = 0
        out.append(full)
    return torch.nested.as_nested_tensor(out, layout=torch.jagged)


def _mini_batch(batches, routes=None):
    ids, lens = [], []
    for b in batches:
        for i, n in enumerate(b.seq_lens):
            off = int(b.cu_seqlens_padded[i])
            ids.append(b.input_ids[off:off + n])
            lens.append(n)
    fields = {"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged)}
    if routes is not None:
        fields[ROUTES_KEY] = torch.nested.as_nested_tensor(
            [t for r, b in zip(routes, batches) for t in _verl_routes(r, b.seq_lens).unbind()], layout=torch.jagged)
    return TensorDict(fields, batch_size=[len(lens)])


def _engine(ctx, chunks, batches, mode, hf=HF, **options):
    eng = Engine.__new__(Engine)
    eng.engine_config = SimpleNamespace(forward_only=False, use_remove_padding=True, pad_to_length=False,
                                        dynamic_context_parallel=False, router_replay=SimpleNamespace(mode="disabled"))
    eng.model_config = SimpleNamespace(hf_config=hf)
    eng.tf_config = chunks[0].config
    eng.module = chunks
    eng.ctx, eng.packed = ctx, batches
    eng.inner = make_forward_step(ctx, thd=False)
    eng.r3_init_state(ReplayConfig(replay_mode=mode, **options))
    eng.r3_attach()
    return eng


def rank_fn(ctx):
    try:
        return _rank(ctx)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def _rank(ctx):
    chunks = build_model_chunks(SPEC, ctx)
    align = align_for(ctx.tp, ctx.cp)
    batches = [make_packed_batch(lens, SPEC.vocab_size, 100 + m, align=align) for m, lens in enumerate(SEQ_LENS)]
    assert len({b.total for b in batches}) == 1
    sp = ctx.tp > 1
    out = {}

    # An HF config that disagrees with the built model (two dense layers, the model has one) is
    # refused at attach: routes would land on the wrong layers (verl #5037's dense-layer shift)
    try:
        _engine(ctx, chunks, batches, "R3", hf={**HF, "first_k_dense_replace": 2})
        out["hf_mismatch"] = "attached"
    except Exception as e:  # noqa: BLE001
        out["hf_mismatch"] = f"{type(e).__name__}: {e}"

    # R3: compute_log_prob (forward only) and update (forward + backward) replay the rollout routes.
    # verl's transport has no per-row validity: the harness's invalid rows are zero rows inside a
    # sample, which the reader refuses by default (vLLM #54730's signature); routed natively here
    eng = _engine(ctx, chunks, batches, "R3", degenerate_routes="native")
    layout = eng.r3.replayer.layout
    routes = [grid.make_routes(layout, lens, SPEC.num_moe_experts, SPEC.moe_router_topk, 7 + m,
                               invalid_every=7 if m == 1 else 0) for m, lens in enumerate(SEQ_LENS)]
    data = _mini_batch(batches, routes)
    eng.forward_backward_batch(data, None, forward_only=True)
    errs = grid._check_probe(eng.probe, batches, routes, ctx, sp, False, eng.r3.replayer.layer_ids)
    upd = eng.forward_backward_batch(data, None, forward_only=False)
    errs += grid._check_probe(eng.probe, batches, routes, ctx, sp, False, eng.r3.replayer.layer_ids)
    out["r3_errors"] = errs
    out["r3_metrics"] = upd.get("metrics", {})
    out["layers"] = eng.r3.replayer.layer_ids
    eng.r3.replayer.detach()

    # R2: record in compute_log_prob, replay the recorded routes (verl layout) in the update
    eng = _engine(ctx, chunks, batches, "R2")
    data = _mini_batch(batches)
    for c in chunks:
        c.eval()
    rec = eng.forward_backward_batch(data, None, forward_only=True)
    for c in chunks:
        c.train()
    if ctx.is_last_stage:
        nested = rec["model_output"][ROUTES_KEY]
        out["r2_nested"] = (nested.is_nested, str(nested.dtype), [tuple(t.shape) for t in nested.unbind()])
        data[ROUTES_KEY] = nested
        recorded = handed_routes(data, moe_layer_ids=eng.r3.model.moe_layer_ids, num_experts=4,
                                 route_kind="recorded").to_batch()
        obj = [recorded.to_bytes()]
    else:
        obj = [None]
    # every stage replays in the update: hand the last stage's routes to the others (verl's trainer
    # does this by putting them in the batch it dispatches to every rank)
    torch.distributed.broadcast_object_list(obj, src=ctx.world_size - 1)
    recorded = ReplayBatch.from_bytes(obj[0])
    data[ROUTES_KEY] = torch.nested.as_nested_tensor(
        [recorded.sequence(i)[0].to(torch.int16) for i in range(recorded.num_seqs)], layout=torch.jagged)
    upd = eng.forward_backward_batch(data, None, forward_only=False)
    per_mb, s = [], 0
    for b in batches:
        per_mb.append(recorded.select(list(range(s, s + len(b.seq_lens)))))
        s += len(b.seq_lens)
    out["r2_errors"] = grid._check_probe(eng.probe, batches, per_mb, ctx, sp, False, eng.r3.replayer.layer_ids)
    out["r2_metrics"] = upd.get("metrics", {})
    return out


@pytest.fixture(scope="module")
def results():
    return spawn_layouts(rank_fn, world_size=2, layouts=LAYOUTS, timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("li", range(len(LAYOUTS)), ids=["tp2_sp", "pp2_vpp2"])
def test_adapter_forward_step_installs_exact_targets(results, li):
    ranks = results[li]
    for r, o in enumerate(ranks):
        assert "error" not in o, f"rank {r}:\n{o['error']}"
        assert o["r3_errors"] == [], f"rank {r} R3: {o['r3_errors'][:5]}"
        assert o["r2_errors"] == [], f"rank {r} R2: {o['r2_errors'][:5]}"
    assert sorted({lid for o in ranks for lid in o["layers"]}) == [1, 2, 3]     # dense layer 0 untouched
    last = [o for o in ranks if "r2_nested" in o]
    assert last
    for o in last:
        is_nested, dtype, shapes = o["r2_nested"]
        assert is_nested and dtype == "torch.int16"
        assert shapes == [(n, 3, 2) for lens in SEQ_LENS for n in lens]        # verl's R2 layout: MoE layers
        m = o["r3_metrics"]
        assert 0.5 < m["r3bridge/update/coverage"][0] < 1.0                     # last rows / invalid rows native
        assert 0.5 < m["r3bridge/old_log_prob/coverage"][0] < 1.0               # reported with the update
        # per-layer agreement of every MoE layer (random rollout targets: well below 1)
        # (3 MoE layers: the default keeps the 3 least-agreeing ones, i.e. all, plus their minimum)
        per_layer = {k: v for k, v in m.items() if re.match(r"r3bridge/update/agreement/layer_\d+$", k)}
        assert sorted(per_layer) == [f"r3bridge/update/agreement/layer_{lid}" for lid in (1, 2, 3)]
        assert all(0.0 <= v[0] < 0.9 for v in per_layer.values())
        assert m["r3bridge/update/agreement/layer_min"] == [min(v[0] for v in per_layer.values())]
        # replaying its own routes with unchanged weights: native == replayed everywhere
        assert o["r2_metrics"]["r3bridge/update/agreement/mean"] == [1.0]


def test_hf_config_that_disagrees_with_the_model_is_refused(results):
    for ranks in results:
        for o in ranks:
            assert o["hf_mismatch"].startswith("LayerMappingError"), o["hf_mismatch"]
            assert "HF config's MoE layers [2, 3] differ from the Megatron model's [1, 2, 3]" in o["hf_mismatch"]
