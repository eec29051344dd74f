"""What every rank of ``r3bridge demo`` runs: a tiny RL loop with a real, independent rollout
engine (HF transformers Qwen3-MoE, :mod:`r3bridge.demo.hf_engine`) and the same model
converted to megatron-core as the trainer, once per replay mode.

Per step and mode (each mode keeps its own weights lineage):

1. **rollout**: the engine holds the trainer's weights of ``lag`` steps ago (asynchronous RL:
   rollout weights lag the trainer), rounded to bf16 (on GPU it also computes in bf16); it samples
   responses to the step's prompts with ``generate()`` (left-padded batch, different prompt and
   response lengths) and reports routes as vLLM does (even steps) or as SGLang's ``meta_info``
   (odd steps), plus the sampled tokens' log-probs;
2. ``compute_log_prob`` (forward-only, weights theta_old): native (off), record (R2) or replay the
   rollout routes (R3), per :func:`r3bridge.config.phase_plan`;
3. **updates**: the batch is split into mini-batches, each a forward+backward with replay per the
   plan and one SGD step on the response tokens' cross-entropy, so later mini-batches are stale
   against the rollout as well.

Measured in the update forwards: route agreement (trainer's dispatched top-k vs the reference
routes: rollout for off / R3, recorded for R2), train-vs-rollout log-prob mismatch over the
sampled tokens, replay coverage; per step and per layer.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Phase, phase_plan
from r3bridge.demo.hf_engine import HFEngine, build_hf_model, tiny_qwen3_moe_config
from r3bridge.demo.hf_to_mcore import (
    from_te_names,
    hf_to_mcore,
    mcore_to_hf,
    packed_from_tokens,
    spec_from_hf,
    to_te_names,
    zero_attention,
)
from r3bridge.metrics import logprob_mismatch_sums, mismatch_from_sums
from r3bridge.parallel.sharding import shard
from r3bridge.testing.harness.data import align_for
from r3bridge.testing.harness.dist import RankContext
from r3bridge.testing.harness.models import build_model_chunks, gather_full_state, load_reference_state
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule


@dataclass(frozen=True)
class DemoOptions:
    modes: tuple[str, ...] = ("off", "R2", "R3")
    steps: int = 4
    seqs_per_step: int = 8
    prompt_len: tuple[int, int] = (16, 64)
    response_len: tuple[int, int] = (32, 96)
    mini_batches: int = 4
    lag: int = 1                 # the rollout engine holds the trainer's weights of `lag` steps ago
    lr: float = 0.003
    seed: int = 0
    verbose: bool = True
    device: str = "cpu"          # "cuda": ranks run on GPUs (NCCL); trainer fp32 as on CPU
    engine_dtype: str = "auto"   # "bf16": weights and compute; "bf16-weights": bf16-rounded weights,
                                 # fp32 compute; "fp32"; auto: bf16 on cuda, bf16-weights on cpu
    layer_spec: str = "local"    # "te": Transformer Engine layer spec (cuda only): TE attention on
                                 # packed THD input, TEGroupedMLP, bf16 trainer (as the TE GPU cells)


# The demo model (a tiny Qwen3-MoE, layer 0 dense): its sizes are also what layout_problem checks,
# without importing transformers, so a bad flag is refused at once.
LAYERS, HEADS, QUERY_GROUPS, EXPERTS = 4, 4, 2, 8


def hf_config():
    return tiny_qwen3_moe_config(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=QUERY_GROUPS, num_experts=EXPERTS)


def layout_problem(tp: int, pp: int, vpp: int | None, ep: int, cp: int, steps: int,
                   opts: "DemoOptions | None" = None) -> str | None:
    """Why the demo model cannot run under this layout (None if it can): checked before any
    process starts, so a bad flag is one clear line, not a traceback from every rank."""
    o = opts or DemoOptions()
    if steps < 1:
        return f"--steps must be >= 1, got {steps}"
    if min(tp, pp, ep, cp) < 1:
        return "--tp/--pp/--ep/--cp must be >= 1"
    if vpp is not None and (vpp < 2 or pp < 2):
        return "--vpp N needs N >= 2 and --pp >= 2 (Megatron refuses virtual stages without pipelining)"
    if LAYERS % (pp * (vpp or 1)):
        return f"the demo model has {LAYERS} layers: pp x vpp = {pp * (vpp or 1)} must divide it"
    if o.layer_spec == "te" and cp > 1:
        return "--spec te runs with --cp 1 (the demo's CP path is the CPU harness's MoE-only layers)"
    if QUERY_GROUPS % tp or EXPERTS % ep:
        return (f"the demo model has {HEADS} attention heads in {QUERY_GROUPS} query groups and {EXPERTS} "
                f"experts: --tp must divide the groups, --ep the experts")
    n, per_update = o.seqs_per_step, _micro_batches_per_update(pp, vpp)
    if n % (_mini_batches(o, pp, vpp) * per_update):
        return f"{n} sequences per step cannot be split into updates of {per_update} micro-batches (--pp {pp})"
    return None


def _micro_batches_per_update(pp: int, vpp: int | None) -> int:
    # the interleaved (VPP) schedule needs at least pp micro-batches per schedule run
    return pp if vpp else 1


def _mini_batches(opts: "DemoOptions", pp: int, vpp: int | None) -> int:
    return max(1, min(opts.mini_batches, opts.seqs_per_step // _micro_batches_per_update(pp, vpp)))


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def _state(chunks) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in c.state_dict().items() if isinstance(v, torch.Tensor)} for c in chunks]


def _install(step, inner, routes_of, ids_of):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        step.install(model, routes_of.get(id(batch)), batch.seq_lens,
                     cu_seqlens_padded=batch.cu_seqlens_padded, sample_ids=ids_of[id(batch)])
        return inner(iter([batch]), model)
    return forward_step


def _engine_dtype(opts: DemoOptions) -> str:
    if opts.engine_dtype != "auto":
        return opts.engine_dtype
    return "bf16" if opts.device == "cuda" else "bf16-weights"


def _push(engine: HFEngine, hf_state: dict[str, torch.Tensor], dtype: str) -> None:
    """Load trainer weights (HF names) into the engine the way an engine takes them: bf16."""
    if dtype == "fp32":
        engine.load_state_dict(hf_state)
    else:
        engine.load_state_dict({k: v.to(torch.bfloat16) for k, v in hf_state.items()})


def _rollout(engine: HFEngine, opts: DemoOptions, step_i: int):
    g = np.random.default_rng(opts.seed * 100003 + step_i)
    vocab = int(engine.model.config.vocab_size)
    n = opts.seqs_per_step
    prompts = [g.integers(1, vocab, size=int(g.integers(opts.prompt_len[0], opts.prompt_len[1] + 1))).tolist()
               for _ in range(n)]
    limits = [int(g.integers(opts.response_len[0], opts.response_len[1] + 1)) for _ in range(n)]
    out = engine.generate(prompts, max_new_tokens=limits, seed=opts.seed * 100003 + step_i)
    E, L, K, moe = engine.num_experts, engine.num_layers, engine.topk, engine.moe_layer_ids
    if step_i % 2 == 0:
        routes = ReplayBatch.from_vllm([c.routed_experts for c in out], num_experts=E, moe_layer_ids=moe)
    else:
        routes = ReplayBatch.from_sglang([c.meta_info() for c in out], num_experts=E, num_layers=L, topk=K,
                                         moe_layer_ids=moe)
    return out, routes


def run_demo(ctx: RankContext, opts: DemoOptions) -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    te = opts.layer_spec == "te"
    attention = "identity" if ctx.cp > 1 else "real"
    cfg = hf_config()
    hf_model = build_hf_model(cfg, seed=1234)
    if attention == "identity":
        zero_attention(hf_model)
    hf_ref = {k: v.clone() for k, v in hf_model.state_dict().items()}
    edtype = _engine_dtype(opts)
    engine_model = copy.deepcopy(hf_model)
    if edtype == "bf16":
        engine_model = engine_model.to(torch.bfloat16)
    engine = HFEngine(engine_model.to(opts.device))
    spec = spec_from_hf(cfg, attention=attention)
    if te:   # bf16 as the TE GPU cells (TE's fused THD attention kernels take fp16 / bf16)
        spec = dataclasses.replace(spec, layer_spec="te", extra_config={
            **spec.extra_config, "bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16})
    trainer = build_model_chunks(spec, ctx)
    reference = hf_to_mcore(hf_ref, cfg, attention=attention)
    load_reference_state(trainer, to_te_names(reference) if te else reference, ctx)
    trainer = [c.to(opts.device, dtype=torch.bfloat16 if te else None) for c in trainer]
    rep = Replayer(trainer)
    layout = rep.layout
    thd = attention == "identity" or te   # TE attention takes the packed THD stream itself
    fwd = make_forward_step(ctx, thd=thd)
    fwd_logits = make_forward_step(ctx, thd=thd, collect_logits=True)
    align = align_for(ctx.tp, ctx.cp)
    last_stage = ctx.is_last_stage
    lineage = {m: _state(trainer) for m in opts.modes}
    history = {m: [hf_ref] for m in opts.modes}    # trainer weights (HF names) at the start of each step
    num_layers = layout.num_layers
    per_mode = {m: dict(agree=torch.zeros(num_layers), total=torch.zeros(num_layers), sums=None, cov=[],
                        agreement_mean=[], steps=[]) for m in opts.modes}
    per_update = _micro_batches_per_update(ctx.pp, ctx.vpp)
    n_groups = _mini_batches(opts, ctx.pp, ctx.vpp) * per_update
    for step_i in range(opts.steps):
        for mode in opts.modes:
            for c, st in zip(trainer, lineage[mode]):
                c.load_state_dict(st, strict=False)
            # 1. rollout with weights `lag` steps old
            _push(engine, history[mode][0], edtype)   # history holds the last lag + 1 versions
            comps, rollout = _rollout(engine, opts, step_i)
            n = len(comps)
            per_mb = n // n_groups
            groups = [list(range(i * per_mb, (i + 1) * per_mb)) for i in range(n_groups)]
            pad_to = max(sum(-(-len(comps[i].tokens) // align) * align for i in grp) for grp in groups)
            batches, rollout_lp, ids_of = [], [], {}
            for grp in groups:
                b = packed_from_tokens([comps[i].tokens for i in grp], align=align, pad_to=pad_to,
                                       loss_from=[len(comps[i].prompt_ids) for i in grp])
                lp = torch.zeros(b.total)
                for j, i in enumerate(grp):
                    off = int(b.cu_seqlens_padded[j]) + len(comps[i].prompt_ids) - 1
                    lp[off:off + len(comps[i].output_ids)] = torch.tensor(comps[i].logprobs)
                b = batch_to(b, opts.device)
                batches.append(b)
                rollout_lp.append(lp)
                ids_of[id(b)] = grp
            roll_of = {id(b): rollout.select(ids_of[id(b)]) for b in batches}
            # 2. compute_log_prob (theta_old)
            plan = phase_plan(mode, Phase.OLD_LOG_PROB)
            for c in trainer:
                c.eval()
            with rep.open_pass(plan.action, forward_only=True, route_kind=plan.route_kind) as ls:
                run_schedule(trainer, batches, _install(ls, fwd, roll_of if plan.route_kind else {}, ids_of),
                             forward_only=True)
            recorded = ls.recorded
            for c in trainer:
                c.train()
            # 3. updates, one SGD step per mini-batch
            plan = phase_plan(mode, Phase.UPDATE)
            ref_of = {id(b): recorded.select(ids_of[id(b)]) for b in batches} if plan.route_kind == "recorded" else roll_of
            opt = torch.optim.SGD([p for c in trainer for p in c.parameters()], lr=opts.lr)
            pm = per_mode[mode]
            step_pm = dict(agree=torch.zeros(num_layers), total=torch.zeros(num_layers), sums=None)
            for u in range(0, len(batches), per_update):
                mini = batches[u:u + per_update]
                opt.zero_grad(set_to_none=True)
                with RoutingProbe(trainer, include_mtp=False) as probe:
                    with rep.open_pass(plan.action, forward_only=False, route_kind=plan.route_kind) as us:
                        res = run_schedule(trainer, mini, _install(us, fwd_logits, ref_of if plan.route_kind else {}, ids_of),
                                           forward_only=False)
                _sync_grads(trainer, ctx)
                opt.step()
                pm["cov"].append(us.metrics.get("r3bridge/coverage", 0.0))
                if plan.route_kind:
                    pm["agreement_mean"].append(us.metrics.get("r3bridge/agreement/mean", 0.0))
                count_agreement(probe, mini, ref_of, layout, ctx, step_pm)
                if last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0:
                    for j, b in enumerate(mini):
                        train_lp = _logprobs(res[j].logits, b.labels)
                        sums = logprob_mismatch_sums(train_lp.cpu(), rollout_lp[u + j], b.loss_mask.bool().cpu(),
                                                     cu_seqlens=b.cu_seqlens_padded.cpu(), exclude_last=False)
                        step_pm["sums"] = sums if step_pm["sums"] is None else step_pm["sums"] + sums
            pm["agree"] += step_pm["agree"]
            pm["total"] += step_pm["total"]
            if step_pm["sums"] is not None:
                pm["sums"] = step_pm["sums"] if pm["sums"] is None else pm["sums"] + step_pm["sums"]
            pm["steps"].append({"agree": float(step_pm["agree"].sum()), "total": float(step_pm["total"].sum()),
                                "sums": None if step_pm["sums"] is None else step_pm["sums"].tolist()})
            lineage[mode] = _state(trainer)
            full = gather_full_state(trainer, ctx)
            history[mode].append(mcore_to_hf(from_te_names(full) if te else full, cfg, hf_ref))
            del history[mode][:-(opts.lag + 1)]
            if opts.verbose and ctx.rank == 0:
                print(f"[r3bridge demo] step {step_i + 1}/{opts.steps} mode {mode} done", file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for mode, pm in per_mode.items():
        out[mode] = {"agree": pm["agree"].tolist(), "total": pm["total"].tolist(),
                     "mismatch": mismatch_from_sums(pm["sums"], prefix="") if pm["sums"] is not None else None,
                     "coverage": sum(pm["cov"]) / len(pm["cov"]) if pm["cov"] else 0.0,
                     "agreement_mean": sum(pm["agreement_mean"]) / len(pm["agreement_mean"]) if pm["agreement_mean"] else None,
                     "steps": pm["steps"]}
    out["rank"] = dict(pp=ctx.pp_rank, tp=ctx.tp_rank, cp=ctx.cp_rank, last=last_stage)
    return out


def batch_to(batch, device: str):
    if device == "cpu":
        return batch
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def _sync_grads(chunks, ctx: RankContext) -> None:
    from r3bridge.testing.harness.schedule import sync_grads
    sync_grads(chunks, ctx)


def count_agreement(probe: RoutingProbe, batches: list, ref_of: dict, layout, ctx: RankContext, pm, *,
                    grad_enabled: bool = True) -> None:
    """Trainer's dispatched top-k vs the reference routes on rows that have a reference route,
    added to ``pm["agree"]`` / ``pm["total"]`` per layer. Per layer, the router calls of one
    schedule run come in micro-batch order (the forward; a recompute, identical by construction,
    would come later). ``grad_enabled``: count the calls of a training (True) or a forward-only
    (False) schedule run."""
    by_layer: dict[int, list] = {}
    for call in probe.calls:
        if call.grad_enabled == grad_enabled:
            by_layer.setdefault(call.layer_id, []).append(call)
    for lid, calls in by_layer.items():
        for b, call in zip(batches, calls):
            t = shard(ref_of[id(b)], layout, b.seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                      cu_seqlens_padded=b.cu_seqlens_padded, layer_ids=[lid])
            got = call.topk().cpu()
            same = (got.sort(1).values == t.indices[lid].sort(1).values).all(1) & t.valid
            pm["agree"][lid] += float(same.sum())
            pm["total"][lid] += float(t.valid.sum())
