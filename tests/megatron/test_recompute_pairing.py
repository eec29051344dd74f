"""Recompute pairing is checked, not assumed (issue 15 part 5), on the real CPU megatron model.

A recompute takes the oldest pending (chunk, micro-batch) of its layer, which is right only if
backward runs in forward order per chunk. Each pairing is checked against a fingerprint of the
router scores taken at the first pass. Scenarios (one rank, one spawn for all):

* ``reversed``: megatron's reentrant full recompute, two micro-batches with the same shape but
  different tokens, backward in *reverse* order: the pairing is wrong and must be refused with a
  ReplayStateError naming layer, chunk and micro-batch (before: silently replayed the other
  micro-batch's routes, same row count so no check fired);
* ``non_reentrant``: torch's non-reentrant checkpointing (``checkpoint_wrapper`` with
  ``CheckpointImpl.NO_REENTRANT`` around every decoder layer, as FSDP-style trainers apply it)
  under megatron's own schedule: the first pass runs with grad enabled, the recompute in backward
  must replay the same targets (before: "router called outside any forward with no recompute
  pending");
* ``frozen_reentrant`` / ``frozen_non_reentrant``: the embedding and decoder layer 0 frozen
  (as LoRA-style partial training does), so layer 0's checkpointed region never runs backward and
  is never recomputed: no false error (before: "recompute never consumed the targets"), and the
  other layers' recomputes replay their own targets.
"""
from __future__ import annotations

import functools
import traceback
from typing import Any

import pytest
from replay_grid import expected_rows, make_routes

from r3bridge.testing.harness import dist
from r3bridge.testing.harness.data import make_packed_batch
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

BASE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=128,
            num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.0)
SEQ_LENS = [[11, 9], [8, 12], [14, 6]]         # equal packed totals: only the fingerprint can tell them apart


def _outcome(fn) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e), "trace": traceback.format_exc()[-3000:]}


def _non_reentrant(chunks) -> None:
    """Wrap every decoder layer in torch's non-reentrant activation checkpointing."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    for c in chunks:
        apply_activation_checkpointing(
            c.decoder, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                               checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, TransformerLayer))


def _freeze_bottom(chunks) -> None:
    """Embedding and decoder layer 0 frozen: nothing below layer 1 needs a gradient."""
    for p in chunks[0].embedding.parameters():
        p.requires_grad_(False)
    for p in chunks[0].decoder.layers[0].parameters():
        p.requires_grad_(False)


def _replayed(ctx, spec: ModelSpec, *, wrap=None, freeze: bool = False) -> dict[str, Any]:
    """Train one 3-micro-batch schedule under R3 replay; per call, did the router return the
    micro-batch's targets (valid rows)? Calls are attributed to micro-batches by install order:
    megatron's no-pipelining schedule runs each micro-batch's forward and backward in turn."""
    from r3bridge.megatron import Replayer

    chunks = build_model_chunks(spec, ctx)
    if wrap is not None:
        wrap(chunks)
    if freeze:
        _freeze_bottom(chunks)
    for c in chunks:
        c.train()
    rep = Replayer(chunks)
    batches = [make_packed_batch(lens, spec.vocab_size, seed=10 + i) for i, lens in enumerate(SEQ_LENS)]
    routes = [make_routes(rep.layout, b.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 40 + i)
              for i, b in enumerate(batches)]
    inner = make_forward_step(ctx, thd=False)
    starts: list[int] = []
    with RoutingProbe(chunks) as probe:
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            def fstep(it, model):
                batch = next(it)
                i = next(j for j, b in enumerate(batches) if b is batch)
                starts.append(len(probe.calls))
                st.install(model, routes[i], batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
                return inner(iter([batch]), model)
            run_schedule(chunks, batches, fstep, forward_only=False)
    starts.append(len(probe.calls))
    calls = []
    for i in range(len(batches)):
        for n, call in enumerate(probe.calls[starts[i]:starts[i + 1]]):
            want, valid = expected_rows(batches[i], routes[i], ctx, False, call.layer_id)
            got = call.topk()
            calls.append({"mb": i, "layer": call.layer_id, "grad": call.grad_enabled, "order": n,
                          "rows": int(valid.sum()), "same": bool((got[valid] == want[valid]).all())})
    grads = {lid: any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in layer.parameters())
             for lid, layer in enumerate(chunks[0].decoder.layers)}
    return {"calls": calls, "grads": grads, "metrics": st.metrics, "layers": rep.chunks[0].layer_ids}


def _reversed_backward(ctx, spec: ModelSpec) -> dict[str, Any]:
    """Two micro-batches forward, then backward of the second before the first."""
    from r3bridge.megatron import Replayer

    chunks = build_model_chunks(spec, ctx)
    model = chunks[0]
    model.train()
    rep = Replayer(chunks)
    batches = [make_packed_batch(SEQ_LENS[0], spec.vocab_size, seed=s) for s in (21, 22)]
    routes = [make_routes(rep.layout, b.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 50 + i)
              for i, b in enumerate(batches)]
    inner = make_forward_step(ctx, thd=False)

    def run(order):
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            losses = []
            for b, r in zip(batches, routes):
                st.install(model, r, b.seq_lens, cu_seqlens_padded=b.cu_seqlens_padded)
                out, loss_fn = inner(iter([b]), model)
                losses.append(loss_fn(out)[0])
            for i in order:
                losses[i].backward()
        return st.metrics
    return {"in_order": _outcome(lambda: run([0, 1])), "reversed": _outcome(lambda: run([1, 0])),
            "state_clean": rep.active_pass is None}


def scenarios(ctx) -> dict[str, Any]:
    full = ModelSpec(**BASE, recompute="full")
    # only layer 0 checkpointed (reentrant), the rest plain: freezing it stops its backward
    block1 = ModelSpec(**BASE, recompute="full", extra_config=dict(recompute_method="block"))
    plain = ModelSpec(**BASE)
    return {
        "reversed": _reversed_backward(ctx, full),
        "reentrant": _outcome(lambda: _replayed(ctx, full)),
        "non_reentrant": _outcome(lambda: _replayed(ctx, plain, wrap=_non_reentrant)),
        "frozen_reentrant": _outcome(lambda: _replayed(ctx, block1, freeze=True)),
        "frozen_non_reentrant": _outcome(lambda: _replayed(ctx, plain, wrap=_non_reentrant, freeze=True)),
    }


@pytest.fixture(scope="module")
def out():
    return dist.spawn(scenarios, world_size=1, timeout=600)[0]


def _value(o):
    assert o["ok"], o.get("trace")
    return o["value"]


def test_backward_out_of_forward_order_is_refused(out):
    r = out["reversed"]
    assert r["in_order"]["ok"], r["in_order"].get("trace")
    bad = r["reversed"]
    assert not bad["ok"], "a recompute paired with the wrong micro-batch was accepted"
    assert "ReplayStateError" in bad["mro"]
    for word in ("layer", "chunk 0", "micro-batch 0", "forward order"):
        assert word in bad["message"], bad["message"]
    assert r["state_clean"]


def _check_replayed(v, *, recomputed_layers, never_recomputed=()):
    calls = v["calls"]
    assert calls and all(c["same"] for c in calls), [c for c in calls if not c["same"]][:3]
    assert all(c["rows"] > 0 for c in calls)
    for mb in range(len(SEQ_LENS)):
        mine = [c for c in calls if c["mb"] == mb]
        fwd = [c["layer"] for c in mine[:len(v["layers"])]]
        assert fwd == v["layers"], f"micro-batch {mb}: forward calls {fwd}"
        again = sorted(c["layer"] for c in mine[len(v["layers"]):])
        assert again == sorted(recomputed_layers), f"micro-batch {mb}: recomputed layers {again}"
        assert not set(again) & set(never_recomputed)


def test_reentrant_recompute_replays_its_own_targets(out):
    v = _value(out["reentrant"])
    _check_replayed(v, recomputed_layers=v["layers"])


def test_non_reentrant_checkpointing_replays_in_forward_and_recompute(out):
    v = _value(out["non_reentrant"])
    _check_replayed(v, recomputed_layers=v["layers"])
    assert all(c["grad"] for c in v["calls"])          # non-reentrant: every pass has grad enabled


@pytest.mark.parametrize("name", ["frozen_reentrant", "frozen_non_reentrant"])
def test_never_recomputed_frozen_layer_is_no_error(out, name):
    v = _value(out[name])
    recomputed = [lid for lid in v["layers"] if lid != 0] if name == "frozen_non_reentrant" else []
    _check_replayed(v, recomputed_layers=recomputed, never_recomputed=[0])
    assert not v["grads"][0] and all(v["grads"][lid] for lid in v["layers"] if lid != 0)
