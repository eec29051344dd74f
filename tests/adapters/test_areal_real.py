"""r3bridge inside AReaL 1.0.4's real Megatron engine (CPU harness).

AReaL's own ``MegatronPPOActor`` (with r3bridge's ``MegatronEngineMixin`` / ``PPOActorMixin``)
runs two PPO steps in a row: ``compute_logp`` (``forward_batch``), ``compute_advantages``,
``ppo_update`` (``train_batch`` with AReaL's GRPO loss, megatron's optimizer over DDP chunks,
full recompute as AReaL's ``gradient_checkpointing`` default), on a tiny Qwen3-MoE that AReaL
builds through mbridge (TE-free spec hook). Routes come from SGLang
``meta_info`` decoded by AReaL's own ``SGLangBackend``. Every router call, forward and recompute,
is checked against the expected routes (testlab.areal_runner). What stands in for what
cannot run on this machine: docs/testing-harness.md, "AReaL's real engine".
"""
from __future__ import annotations

import importlib.util
import math

import pytest

from r3bridge.testing.harness.dist import Layout, spawn_layouts

assert importlib.util.find_spec("areal") is not None, "areal is not installed: run `make install`"

# TP2 runs one micro-batch per pass: AReaL pads each micro-batch to a 256-token page, so with two
# the second sequence-parallel half would hold padding only and nothing would be checked there.
# Under PP AReaL itself raises every pass to at least 2 * pp micro-batches (megatron_engine.py), so
# PP2 x VPP2 runs 4 per pass whatever n_mbs says: the interleaved schedule's steady state included.
MB = {(1, 1, None): dict(n_mbs=2, ppo_n_minibatches=2), (2, 1, None): dict(n_mbs=1, ppo_n_minibatches=1),
      (1, 2, 2): dict(n_mbs=2, ppo_n_minibatches=2)}


def _cell(ctx, workdir):
    from r3bridge.testing.kit.conformance import make_rollout
    from testlab.areal_runner import run_steps

    # 4 layers, layer 0 dense, 4 experts, top-2 (the model: the same, as a Qwen3-MoE through mbridge)
    rollout = make_rollout(11, batch_size=8, num_experts=4, topk=2, max_prompt=40)
    kw = MB[(ctx.tp, ctx.pp, ctx.vpp)]
    out = {}
    for mode in ("R3", "R2"):
        res = run_steps(ctx, mode, rollout, f"{workdir}/rank{ctx.rank}", steps=2, **kw)
        res["num_records"] = len(res.pop("records"))
        out[mode] = res
    if ctx.world_size == 1:
        from testlab.areal_engine import reference_roles
        out["roles"] = reference_roles(ctx, f"{workdir}/rank{ctx.rank}/roles")
    return out


def _check(lay, per_rank):
    for rank, r in enumerate(per_rank):
        where = (lay, rank)
        for mode in ("R3", "R2"):
            res = r[mode]
            assert res["errors"] == [], (where, mode, res["errors"][:5])
            assert res["checked_rows"] > 0, (where, mode)
            calls = res["calls"]
            assert calls["compute_log_prob/grad=off"] > 0 and calls["update/grad=on"] > 0, (where, calls)
            assert calls["update/recompute"] > 0, (where, calls)            # recompute calls were checked too
            assert res["num_records"] == sum(v for k, v in calls.items() if "/grad=" in k), (where, calls)
            g1, g2 = res["grad_norms"]
            assert math.isfinite(g1) and math.isfinite(g2) and g1 != g2, (where, res["grad_norms"])
        for step in range(2):
            m3, m2 = r["R3"]["metrics"][step], r["R2"]["metrics"][step]
            for m in (m3, m2):      # the names docs/metrics.md documents, unscoped; AReaL adds <key>__count
                _check_logged(m.keys(), framework_suffixes=("__count",))
            # what the mixin logged into AReaL's stats tracker, exported with the step's stats
            upd3 = {k.split("r3bridge/update/")[1]: v for k, v in m3.items() if "r3bridge/update/" in k}
            upd2 = {k.split("r3bridge/update/")[1]: v for k, v in m2.items() if "r3bridge/update/" in k}
            # R2: the recorded routes; the model's own choices drift after the first mini-batch's
            # optimizer step (ppo_n_minibatches=2), so agreement is high but need not be 1
            assert 0.9 < upd2["agreement/mean"] <= 1.0, (where, step, upd2)
            # R2 records every real token, so its coverage is 1 exactly; AReaL's trailing page-padding
            # "sequence" is no sample's token and is not counted (as `r3bridge inspect` counts)
            assert upd2["coverage"] == 1.0 and upd2["native_pairs"] == 0.0, (where, step, upd2)
            # R3 replays the rollout's routes, which the model would not have chosen itself
            assert upd3["agreement/mean"] < 0.9, (where, step, upd3)
            assert 0.5 < upd3["coverage"] < 1.0, (where, step, upd3)


@pytest.mark.slow
def test_areal_engine_one_rank(tmp_path):
    (per_rank,) = spawn_layouts(_cell, world_size=1, layouts=[Layout()], args=(str(tmp_path),), timeout=600)
    _check(Layout(), per_rank)
    # roles (r3bridge.megatron.roles; NeMo RL #4083): the reference engine trainer_class builds
    # declares its model the reference and refuses a replay object; the actor engine refuses role=ref
    roles = per_rank[0]["roles"]
    assert roles["reference"] == ["reference"], roles
    for scenario in ("reference_with_megatron_replay", "actor_engine_as_reference"):
        msg = roles[scenario]
        assert msg.startswith("RoleError: ") and "reference" in msg and "actor" in msg, (scenario, msg)


@pytest.mark.slow
def test_areal_engine_tp2_and_pp2_vpp2(tmp_path):
    layouts = [Layout(tp=2), Layout(pp=2, vpp=2)]
    res = spawn_layouts(_cell, world_size=2, layouts=layouts, args=(str(tmp_path),), timeout=900)
    for lay, per_rank in zip(layouts, res):
        _check(lay, per_rank)


def _check_logged(*args, **kwargs) -> None:
    from _documented_metrics import check_logged  # tests/adapters helper (not importable in workers)
    check_logged(*args, **kwargs)
