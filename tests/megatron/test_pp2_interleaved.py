"""Two pipeline stages with virtual stages: megatron's batched p2p swaps the two directions, so
r3bridge refuses ``batch_p2p_comm=True`` there (``r3bridge.megatron.guards``; the guard's other
rule, ``overlap_p2p_comm`` with ``variable_seq_lengths``, is in test_releases.py).

With pp = 2 the previous and the next stage are one rank. In the interleaved steady state both
ranks post ``send_prev, recv_prev, send_next, recv_next`` to that rank in one batch, and
point-to-point ops to one peer pair in posting order, so activations and gradients cross (no
error: the shapes are equal). The first test shows the effect on megatron's own schedule: the
training schedule's losses (forward + backward, interleaved 1F1B) must equal a forward-only pass
over the same micro-batches with the same weights; with ``batch_p2p_comm=True`` they do not from
the first micro-batch that follows a steady-state exchange. If a megatron-core release fixes it,
that test fails and the guard can admit the release.
"""
from __future__ import annotations

import traceback

import pytest

from r3bridge import ConfigError
from r3bridge.testing.harness.dist import Layout, spawn_layouts


def _losses(ctx, batch_p2p: bool) -> dict:
    try:
        from r3bridge.config import ReplayConfig
        from r3bridge.megatron import Replayer
        from r3bridge.testing.harness.data import make_packed_batch
        from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
        from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

        spec = ModelSpec(num_layers=4, extra_config={"batch_p2p_comm": batch_p2p, "overlap_p2p_comm": not batch_p2p})
        chunks = build_model_chunks(spec, ctx)
        # 4 equal-length micro-batches: the schedule has a steady state (2 micro-batches would not)
        mbs = [make_packed_batch([10, 6], spec.vocab_size, 5 + m, pad_to=16) for m in range(4)]
        step = make_forward_step(ctx, thd=False)
        for c in chunks:
            c.eval()
        out = {"forward_only": [r.loss for r in run_schedule(chunks, mbs, step, forward_only=True)],
               "training": [r.loss for r in run_schedule(chunks, mbs, step, forward_only=False)]}
        try:
            Replayer.from_config(chunks, ReplayConfig(replay_mode="R3")).detach()
            out["attach"] = "attached"
        except ConfigError as e:
            out["attach"] = str(e)
        return out
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def results():
    return {bp: spawn_layouts(_losses, world_size=2, layouts=[Layout(pp=2, vpp=2)], args=(bp,), timeout=300)[0]
            for bp in (True, False)}


@pytest.mark.slow
def test_batched_p2p_corrupts_the_interleaved_pp2_training_schedule(results):
    for bp, ranks in results.items():
        for r, o in enumerate(ranks):
            assert "error" not in o, f"batch_p2p_comm={bp} rank {r}:\n{o['error']}"
    last = {bp: ranks[1] for bp, ranks in results.items()}            # the last stage reports losses
    ok, bad = last[False], last[True]
    assert len(ok["training"]) == len(ok["forward_only"]) == 4
    assert ok["training"] == pytest.approx(ok["forward_only"], abs=1e-6)      # unbatched: exact
    assert bad["forward_only"] == pytest.approx(ok["forward_only"], abs=1e-6)  # forward-only never sends back
    wrong = [k for k, (a, b) in enumerate(zip(bad["training"], bad["forward_only"])) if abs(a - b) > 1e-4]
    assert wrong, f"megatron's batched p2p no longer swaps directions at pp=2: {bad}"


@pytest.mark.slow
def test_replayer_refuses_batched_p2p_at_pp2_with_virtual_stages(results):
    for ranks in results[True]:
        assert "batch_p2p_comm=True" in ranks["attach"] and "Megatron-LM #1450" in ranks["attach"], ranks["attach"]
    for ranks in results[False]:
        assert ranks["attach"] == "attached", ranks["attach"]
