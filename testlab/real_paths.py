"""One canonical rollout through verl's, SkyRL's and AReaL's real training paths (tests and device
scripts): the rank functions of tests/adapters/test_real_paths_agree.py (CPU, 2 gloo ranks) and
scripts/gpu/cross_framework.py (the same on GPUs).

Each rank function runs one framework's runner on the rollout (R3, full recompute) and returns
its dispatch records (every router row mapped back to (sample, token) with the packing the
framework really used), its own router-call check (``errors``, ``checked``) and how many
micro-batches each pass had. The caller merges the ranks and compares
(``testlab.dispatch_records.compare_dispatch``).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["rollout", "run_verl", "run_skyrl", "run_areal", "PERMUTE"]

PERMUTE = [5, 1, 0, 4, 2, 7, 3, 6]  # the SkyRL update sees the samples in another order, re-partitioned


def rollout() -> Any:
    """The three models' rollout: 4 layers, layer 0 dense, 8 experts, top-2, vocabulary >= 64
    (verl's tokenizer). 189 tokens, the longest 30: AReaL's one 256-row micro-batch then has real
    tokens on both sequence-parallel halves; verl's dynamic-bsz budget (48 tokens) still fits every
    sample."""
    from r3bridge.testing.kit.conformance import make_rollout

    return make_rollout(
        7, batch_size=8, num_experts=8, topk=2, num_layers=4, moe_layer_ids=[1, 2, 3], vocab=64, max_prompt=24
    )


def run_verl(ctx: Any, model_dir: str, rollout: Any) -> dict:
    from testlab import verl_job as vj

    job = vj.JobLayout(tp=ctx.tp, pp=ctx.pp, vpp=ctx.vpp, recompute=True)
    res = vj.run_training_worker(ctx, model_dir, job, "R3", 1, canonical=[rollout])
    return {
        "dispatch": res["dispatch"],
        "errors": [m for p in res["passes"] for m in p.mismatches],
        "checked": sum(p.checked_rows for p in res["passes"]),
        # chunk 0's packed micro-batches in compute_log_prob and the update, as verl split them
        "micro_batches": [len(p.micro_batches) for p in res["passes"]],
    }


def run_skyrl(ctx: Any, rollouts: list, layer_spec: Optional[str] = None) -> dict:
    """SkyRL's wrapper on ``rollouts`` (one step each). ``layer_spec=None``: the CPU test's choice
    (TP: left-padding removal (BSHD) with real local attention; PP: THD packing, MoE-only layers,
    as test_skyrl_real.py trains it); ``"te"`` / ``"local"``: THD packing on
    :func:`testlab.device_runs.skyrl_spec` (the device scripts)."""
    from r3bridge.testing.harness.models import ModelSpec
    from testlab.skyrl_real import StepSpec, run_steps

    if layer_spec is not None or ctx.pp > 1:
        # the device scripts' spec; under PP the CPU test trains SkyRL's THD path on the same
        # MoE-only ("local") model (megatron's local attention refuses packed sequences)
        from testlab.device_runs import skyrl_spec

        spec = skyrl_spec(layer_spec or "local")
        step = StepSpec(mode="R3", remove_microbatch_padding=True, micro_train_batch_size=2, permute=PERMUTE)
    else:
        spec = ModelSpec(
            num_layers=4,
            moe_layer_freq=[0, 1, 1, 1],
            num_moe_experts=8,
            moe_router_topk=2,
            attention="real",
            recompute="full",
        )
        step = StepSpec(mode="R3", remove_microbatch_padding=False, permute=PERMUTE)
    res = run_steps(ctx, spec, step, rollouts)
    # the runner's own check against the rollouts' routes
    errors = [e for s in res["steps"] for e in s["fwd_errors"] + s["upd_errors"]]
    # the runner's check holds one router call per (chunk, layer, pass) for each of these micro-batches
    n = len(rollouts[0].tokens)
    return {
        "dispatch": res["dispatch"],
        "errors": errors,
        "checked": sum(s["fwd_checked"] + s["upd_checked"] for s in res["steps"]),
        "micro_batches": [-(-n // step.micro_forward_batch_size), -(-n // step.micro_train_batch_size)],
    }


def run_areal(ctx: Any, workdir: str, rollout: Any, device: str = "cpu") -> dict:
    from testlab.areal_runner import run_steps

    # n_mbs=1: one micro-batch per pass at TP2 (AReaL pads each to a 256-token page:
    # test_areal_real.py); under PP AReaL itself splits each pass into at least 2 * pp micro-batches
    # (4 here, of different lengths: the interleaved schedule's warm-up, steady state and cool-down)
    res = run_steps(
        ctx, "R3", rollout, f"{workdir}/rank{ctx.rank}", steps=1, n_mbs=1, ppo_n_minibatches=1, device=device
    )
    # micro-batches each pass's router calls were matched to (compute_log_prob, then the update)
    mbs: dict[str, int] = {}
    for r in res["records"]:
        mbs[r["phase"]] = max(mbs.get(r["phase"], 0), r["micro_batch"] + 1)
    return {
        "dispatch": res["dispatch"],
        "errors": res["errors"],
        "checked": res["checked_rows"],
        "micro_batches": [mbs.get("compute_log_prob", 0), mbs.get("update", 0)],
    }
