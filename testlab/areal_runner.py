"""One AReaL training step after another on the real engine, every router call checked (tests only).

Rollout: :func:`testlab.areal_rollout.trajectories` (AReaL's own ``SGLangBackend``
decoding SGLang's ``meta_info``, r3bridge's ``WorkflowMixin``), or the trajectories of a real SGLang
server's rollout through AReaL's own engine client (:mod:`testlab.areal_sglang`). Trainer:
:func:`testlab.areal_engine.make_actor` (AReaL's ``MegatronPPOActor`` with r3bridge's
mixins, a tiny Qwen3-MoE matching the rollout built through mbridge). :func:`run_steps` runs
``compute_logp`` -> ``compute_advantages`` -> ``ppo_update`` (AReaL's GRPO loss and optimizer
step) per step under a :class:`~r3bridge.testing.harness.probe.RoutingProbe` and checks every router call,
forward and recompute, against the expected routes: the canonical rollout's (R3) or the routes
recorded in that step's ``compute_logp`` (R2), sharded with ``r3bridge.shard`` for the packing
AReaL really used (its padded ``cu_seqlens``, its sample order after its own token-balanced
splits).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from r3bridge.adapters.areal.hooks import MB_KEY
from r3bridge.testing.kit.conformance import CanonicalRollout
from testlab.areal_env import import_areal

__all__ = ["run_steps"]



class _PassLog:
    """Per ``forward_backward_batch`` call of the engine: the phase, the first/last router call
    index in the probe, and each padded micro-batch's (seq_lens, batch sample ids, padded
    cu_seqlens) exactly as the engine handed them to the schedule. Installed on the engine
    instance (test-side capture; the engine's method runs unchanged)."""

    def __init__(self, engine: Any, probe: Any) -> None:
        self.engine, self.probe, self.passes = engine, probe, []
        self._orig = engine.forward_backward_batch

        def forward_backward_batch(mb_list, process_output_fn, forward_only=False):
            start = len(self.probe.calls)
            phase = engine.r3_phase.value if engine.r3_phase is not None else None
            mbs = []
            for pmb in mb_list.padded_mbs:
                item = pmb.get(MB_KEY)          # the adapter's per-micro-batch r3bridge.megatron.MicroBatch
                lens, gids = (list(item.seq_lens), list(item.sample_ids)) if item is not None else (None, None)
                mbs.append((lens, gids, pmb["cu_seqlens"].cpu().clone()))
            out = self._orig(mb_list, process_output_fn, forward_only)
            self.passes.append(dict(phase=phase, forward_only=forward_only, start=start,
                                    end=len(self.probe.calls), mbs=mbs))
            return out
        engine.forward_backward_batch = forward_backward_batch

    def remove(self) -> None:
        del self.engine.forward_backward_batch


def _check_pass(ctx: Any, layout: Any, p: dict, calls: list, expected: Any, log: Any = None, step: int = 0
                ) -> tuple[list, list, int]:
    """Every router call of one pass against ``expected`` (ReplayBatch in batch order); ``log``
    (a :class:`~testlab.dispatch_records.DispatchLog`) gets every real row's dispatch."""
    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.parallel.sharding import shard
    from testlab.dispatch_records import router_rows

    errors, records, checked = [], [], 0
    seen: dict[tuple, int] = {}
    for call in calls:
        key = (call.chunk, call.layer_id, call.grad_enabled)
        k = seen.get(key, 0)          # each chunk runs its micro-batches in order, forward and recompute alike
        seen[key] = k + 1
        if k >= len(p["mbs"]):
            errors.append(f"{p['phase']}: chunk {call.chunk} layer {call.layer_id}: more router calls than micro-batches")
            continue
        lens, gids, cu = p["mbs"][k]
        real = [g for g in gids if g is not None]       # None: AReaL's padding "sequence"
        routes = expected.select(real)
        if len(lens) > len(real):     # AReaL's trailing padding "sequence": no routes
            extra = ReplayBatch.from_packed(torch.zeros((0, routes.num_layers, routes.topk), dtype=routes.routes.dtype),
                                            [0] * (len(lens) - len(real)), num_experts=routes.num_experts,
                                            layer_ids=routes.layer_ids, start_rows=lens[len(real):], route_kind=routes.route_kind,
                                            engine=routes.engine)
            routes = ReplayBatch.concat([routes, extra])
        tg = shard(routes, layout, lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank, pp_rank=ctx.pp_rank,
                   vp_stage=call.chunk, layer_ids=[call.layer_id], format="thd", cu_seqlens_padded=cu)
        got = call.topk().cpu()        # the router's device (a GPU on the device scripts)
        if log is not None:
            sample, token = router_rows(real, lens, layout, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                                        cu_seqlens_padded=cu)
            log.add(step=step, phase=p["phase"], grad=call.grad_enabled, layer=call.layer_id, topk=got,
                    sample=sample, token=token)
        want = tg.indices[call.layer_id].sort(dim=1).values
        v = tg.valid
        where = f"{p['phase']} mb {k} chunk {call.chunk} layer {call.layer_id} grad={call.grad_enabled}"
        if got.shape != want.shape:
            errors.append(f"{where}: router saw {tuple(got.shape)} rows, targets {tuple(want.shape)}")
            continue
        bad = int((got[v] != want[v]).any(1).sum())
        if bad:
            errors.append(f"{where}: {bad} of {int(v.sum())} valid rows differ")
        checked += int(v.sum())
        records.append(dict(phase=p["phase"], micro_batch=k, samples=real, chunk=call.chunk, layer=call.layer_id,
                            grad_enabled=call.grad_enabled, valid=v.clone(), topk=got.to(torch.uint8), mismatched=bad))
    return errors, records, checked


def _fresh_trajectories(rollout: Any) -> list[dict]:
    """This step's trajectory dicts: built from a canonical rollout through AReaL's client code, or
    copies of the ones a real rollout returned (``testlab.areal_sglang.RecordedRollout``: the
    trainer adds and replaces fields, every step starts from the rollout's)."""
    if isinstance(rollout, CanonicalRollout):
        from testlab.areal_rollout import trajectories

        return trajectories(rollout)
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in rollout.trajectories]


def run_steps(ctx: Any, mode: str, rollout: Any, workdir: str, *, steps: int = 2, n_mbs: int = 2,
              ppo_n_minibatches: int = 2, recompute: bool = True, trace_dir: Optional[str] = None,
              device: str = "cpu", hf_config: Any = None) -> dict:
    """``steps`` AReaL PPO steps on the same rollout (``compute_logp``, ``compute_advantages``,
    ``ppo_update``), every router call checked. Returns plain data: ``errors`` (empty when every
    call dispatched the expected routes), ``checked_rows``, ``calls`` per phase, ``metrics`` (the
    stats AReaL's tracker exported), ``records`` (per router call: phase, micro-batch, rollout
    samples, chunk, layer, grad_enabled, valid rows, dispatched top-k ids), ``dispatch`` (this
    rank's :class:`~testlab.dispatch_records.DispatchRecords`: every real token's
    dispatched ids per (step, phase, grad, sample, token, layer), for comparing frameworks),
    ``recorded`` (R2: each step's recorded routes, ``ReplayBatch.to_bytes``). ``device``: "cpu"
    (the CPU harness) or "cuda" (``testlab.areal_engine.make_actor`` on this rank's GPU). ``rollout``: a
    :class:`CanonicalRollout`, or a real rollout's trajectories (``testlab.areal_sglang.RecordedRollout``:
    ``trajectories``, ``expected()``, the model's facts); ``hf_config``: the model the rollout served
    (default: a tiny Qwen3-MoE with the rollout's layers, experts and top-k)."""
    from r3bridge.testing.harness.probe import RoutingProbe
    from testlab.areal_engine import chunks_of, make_actor
    from testlab.dispatch_records import DispatchLog
    from testlab.mbridge_spec import tiny_qwen3_moe

    st = import_areal("areal.utils.stats_tracker")
    data_mod = import_areal("areal.utils.data")
    hf = hf_config if hf_config is not None else tiny_qwen3_moe(
        num_layers=rollout.num_layers, dense=tuple(i for i in range(rollout.num_layers) if i not in rollout.moe_layer_ids),
        num_experts=rollout.num_experts, topk=rollout.topk)
    eng = make_actor(ctx, mode, workdir, hf_config=hf, n_mbs=n_mbs, ppo_n_minibatches=ppo_n_minibatches,
                     recompute=recompute, trace_dir=trace_dir, device=device)
    chunks = chunks_of(eng)
    layout = eng.r3.replayer.layout
    canonical = rollout.expected()
    errors: list = []
    records: list = []
    checked = 0
    calls: dict = {}
    metrics: list = []
    grad_norms: list = []
    recorded_per_step: list = []
    dispatch = DispatchLog("areal")
    for step in range(steps):
        # on the engine's device, as AReaL's trainer hands them over: its DistRolloutCoordinator
        # moves the rollout's trajectories with tensor_container_to(.., current_device()) before
        # compute_logp (areal/infra/dist_rollout.py, rollout_batch / prepare_batch); compute_logp's
        # prox_logp comes back on that device and compute_advantages mixes it with loss_mask
        trajs = data_mod.tensor_container_to(_fresh_trajectories(rollout), eng.device)
        with RoutingProbe(chunks, include_mtp=False) as probe:
            log = _PassLog(eng, probe)
            try:
                logp = eng.compute_logp(trajs)
                for t, lp in zip(trajs, logp):
                    t["prox_logp"] = lp
                recorded = None if eng.r3.result is None else eng.r3.result.recorded
                recorded_per_step.append(None if recorded is None else recorded.to_bytes())
                trajs = eng.compute_advantages(trajs)
                eng.ppo_update(trajs)
            finally:
                log.remove()
        exported = st.export()
        metrics.append({k: v for k, v in exported.items() if "r3bridge/" in k and not k.endswith("__count")})
        grad_norms.append(exported.get("ppo_actor/update/grad_norm"))
        for p in log.passes:
            want = canonical
            if mode == "R2":
                want = recorded
                if recorded is None:
                    errors.append(f"step {step}: R2 recorded nothing in compute_logp")
                    continue
            p_err, p_rec, p_checked = _check_pass(ctx, layout, p, probe.calls[p["start"]:p["end"]], want,
                                                    dispatch, step)
            errors += [f"step {step}: {e}" for e in p_err]
            for r in p_rec:
                r["step"] = step
            records += p_rec
            checked += p_checked
            key = f"{p['phase']}/grad={'on' if not p['forward_only'] else 'off'}"
            calls[key] = calls.get(key, 0) + (p["end"] - p["start"])
            calls[p["phase"] + "/recompute"] = calls.get(p["phase"] + "/recompute", 0) + sum(
                1 for c in probe.calls[p["start"]:p["end"]] if c.grad_enabled)
    return dict(errors=errors, checked_rows=checked, calls=calls, metrics=metrics, records=records,
                dispatch=dispatch.records(),
                grad_norms=grad_norms, recorded_rows=None if mode != "R2" else recorded.rows_per_seq,
                recorded=recorded_per_step if mode == "R2" else None)
