"""The evidence loop's R3w arm (r3bridge/demo/grpo.py): R3 with routing weights replayed
(``replay_weights=recorded``): compute_log_prob replays the engine's ids and records their
combine weights, every update replays ids and weights. Run for real at a tiny size (HF
transformers engine, megatron-core trainer, CPU), two GRPO steps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from r3bridge.testing.harness.dist import spawn


def _r3w_arm(ctx, root: str) -> str:
    import torch

    from r3bridge.demo import evidence_config
    from r3bridge.demo.grpo import HFRollout, _run_one
    from r3bridge.demo.task import AdditionTask
    from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions, warm_start

    run_dir = Path(root)
    for sub in ("logs", "warmstart"):
        (run_dir / sub).mkdir(parents=True)
    shape, task = EvidenceModelShape(layers=2), AdditionTask()
    warm = WarmStartOptions(steps=2, batch=16, aux_loss=0.4, router_z_loss=0.05)
    state, _ = warm_start(shape, task, warm)
    torch.save(state, run_dir / "warmstart" / "state.pt")
    # the trainer keeps the warm start's router losses during GRPO: megatron computes them on the
    # replayed routing map, with the rows that have no route masked out of their statistics
    run = evidence_config.RunConfig(shape=shape, task=task, warm=warm,
                                    grpo=evidence_config.GRPOOptions(steps=2, prompts=4, group=2, router_losses=1.0),
                                    arms=[evidence_config.Arm("R3w-s0", "R3w", 0, "hf")])
    return _run_one(ctx, run_dir, run, run.arms[0], HFRollout(shape.hf_config(), "cpu"))


def test_r3w_arm_runs_two_steps_replaying_ids_and_weights(tmp_path):
    status = spawn(_r3w_arm, world_size=1, args=(str(tmp_path / "run"),), timeout=600)[0]
    assert status == "done"
    lines = [json.loads(x) for x in (tmp_path / "run" / "logs" / "R3w-s0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    for line in lines:
        d = line["data"]
        # compute_log_prob replays the engine's routes (each sequence's last token has none)
        assert 0.8 < d["actor/r3bridge/old_log_prob/coverage"] < 1.0
        # the updates replay compute_log_prob's recording: every token has ids and weights
        assert d["actor/r3bridge/update/coverage"] == 1.0
        assert d["actor/r3bridge/update/weights/replayed_pairs"] > 0
        assert d["actor/r3bridge/update/weights/live_pairs"] == 0
        # the first update runs at theta_old with compute_log_prob's ids and exactly its weights
        # (float32 in process): its log-probs are compute_log_prob's up to the other packing's
        # float rounding (was 2e-6 with the weights narrowed to float16)
        assert d["actor/first_update/abs_log_ratio"] < 1e-6
        # both router losses ran in every update (before their coefficients: a switch loss is about 1
        # near balance and at least 1 - 1/experts... above 0; the z-loss is logsumexp^2 > 0)
        assert d["actor/router/load_balancing_loss"] > 0.5 and d["actor/router/z_loss"] > 0


def test_trainer_router_losses_match_the_warm_starts_pull():
    """HF's switch loss spans every MoE layer's tokens at once, megatron's is one per layer: the
    coefficient that gives a router probability the same gradient is aux x top-k / MoE layers."""
    import torch

    from r3bridge.demo.grpo import trainer_router_losses
    from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions

    cfg = EvidenceModelShape(layers=4, experts=64, topk=8).hf_config()
    assert trainer_router_losses(WarmStartOptions(aux_loss=1.0, router_z_loss=0.1), cfg) == (2.0, 0.1)
    dense = EvidenceModelShape(layers=4, experts=64, topk=8, dense_first=True).hf_config()
    assert trainer_router_losses(WarmStartOptions(aux_loss=1.0, router_z_loss=0.0), dense) == (8 / 3, None)
    assert trainer_router_losses(WarmStartOptions(aux_loss=1.0, router_z_loss=0.1), cfg, 0.1) == pytest.approx((0.2, 0.01))
    # the gradient claim itself, on HF's own loss and megatron's, for an imbalance every layer shares
    # (the experts' loads per layer equal the all-layer ones up to sampling noise; an imbalance of one
    # layer alone megatron's per-layer loss pulls harder)
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers, tokens, experts, k = 2, 4096, 16, 4
    logits = torch.randn(layers, tokens, experts, generator=torch.Generator().manual_seed(0)) * 0.01
    logits = logits + torch.linspace(-0.5, 0.5, experts)
    hf = logits.clone().requires_grad_(True)
    load_balancing_loss_func(tuple(hf), experts, k).backward()
    mc = logits.clone().requires_grad_(True)
    coeff, _ = trainer_router_losses(WarmStartOptions(aux_loss=1.0), EvidenceModelShape(layers=layers, experts=experts,
                                                                                      topk=k).hf_config())
    total = torch.zeros(())
    for layer in range(layers):
        p = torch.softmax(mc[layer], -1)
        counts = torch.zeros(experts).scatter_add_(0, torch.topk(p, k, -1).indices.flatten(), torch.ones(tokens * k))
        total = total + switch_load_balancing_loss_func(p, counts, tokens, k, experts, coeff)
    total.backward()
    ratio = mc.grad.norm() / hf.grad.norm()
    # (the HF coefficient taken as it is, 1.0, would pull half as hard here: layers / k)
    assert abs(float(ratio) - 1.0) < 0.03, float(ratio)
