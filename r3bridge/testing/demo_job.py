"""What every rank of ``r3bridge demo`` runs: a tiny RL-shaped loop on a real megatron-core MoE
model, once per replay mode, so the effect of replay on routing and log-probs is visible.

Per step and mode (each mode keeps its own weights lineage, same sampled tokens):

1. the "rollout engine" is a second copy of the model holding the trainer's current weights
   rounded to **bf16**; it computes the sampled tokens' log-probs and its routes (recorded through
   r3bridge, last row of each sequence dropped as vLLM / SGLang do);
2. ``compute_log_prob`` (forward-only, weights theta_old): native (off), record (R2) or replay the
   rollout routes (R3);
3. the update: the batch is split into mini-batches, each a forward+backward with replay per
   :func:`r3bridge.config.phase_plan` and one SGD step, so later mini-batches are stale
   against the rollout.

Measured in the update forwards: route agreement (trainer's dispatched top-k vs the reference
routes: rollout for off / R3, recorded for R2), train-vs-rollout log-prob mismatch, and replay
coverage. Sampling is not autoregressive: sequences are random tokens (the demo is about
routing replay, not generation).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from r3bridge.config import Phase, phase_plan
from r3bridge.metrics import logprob_mismatch_sums, mismatch_from_sums
from r3bridge.schema import ReplayBatch
from r3bridge.sharding import shard
from r3bridge.testing.data import align_for, batch_to, make_packed_batch
from r3bridge.testing.dist import RankContext
from r3bridge.testing.models import ModelSpec, build_model_chunks
from r3bridge.testing.probe import RoutingProbe
from r3bridge.testing.schedule import make_forward_step, run_schedule


@dataclass(frozen=True)
class DemoOptions:
    modes: tuple[str, ...] = ("off", "R2", "R3")
    steps: int = 2
    seqs_per_step: int = 8
    min_len: int = 160
    max_len: int = 352
    mini_batches: int = 4
    lr: float = 0.02
    seed: int = 0
    verbose: bool = True
    device: str = "cpu"          # "cuda": ranks run on GPUs (NCCL), fp32 trainer as on CPU


def layout_problem(tp: int, pp: int, vpp: int | None, ep: int, cp: int, steps: int,
                   opts: "DemoOptions | None" = None) -> str | None:
    """Why the demo model cannot run under this layout (None if it can): checked before any
    process starts, so a bad flag is one clear line, not a traceback from every rank."""
    spec, o = demo_spec(cp), opts or DemoOptions()
    if steps < 1:
        return f"--steps must be >= 1, got {steps}"
    if min(tp, pp, ep, cp) < 1:
        return "--tp/--pp/--ep/--cp must be >= 1"
    if vpp is not None and (vpp < 2 or pp < 2):
        return "--vpp N needs N >= 2 and --pp >= 2 (Megatron refuses virtual stages without pipelining)"
    if spec.num_layers % (pp * (vpp or 1)):
        return f"the demo model has {spec.num_layers} layers: pp x vpp = {pp * (vpp or 1)} must divide it"
    if spec.num_attention_heads % tp or spec.num_moe_experts % ep:
        return (f"the demo model has {spec.num_attention_heads} attention heads and {spec.num_moe_experts} "
                f"experts: --tp must divide the first, --ep the second")
    n, per_update = o.seqs_per_step, _micro_batches_per_update(pp, vpp)
    if n % (_mini_batches(o, pp, vpp) * per_update):
        return f"{n} sequences per step cannot be split into updates of {per_update} micro-batches (--pp {pp})"
    return None


def _micro_batches_per_update(pp: int, vpp: int | None) -> int:
    # the interleaved (VPP) schedule needs at least pp micro-batches per schedule run
    return pp if vpp else 1


def _mini_batches(opts: "DemoOptions", pp: int, vpp: int | None) -> int:
    return max(1, min(opts.mini_batches, opts.seqs_per_step // _micro_batches_per_update(pp, vpp)))


def demo_spec(cp: int) -> ModelSpec:
    # 4 layers, layer 0 dense; 8 experts top-2; router init as small as the rest so that, as in
    # real models, many tokens sit near a routing tie and bf16 numerics / staleness flip them.
    return ModelSpec(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     vocab_size=256, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=[0, 1, 1, 1],
                     attention="identity" if cp > 1 else "real", router_init_std=0.02, seed=1234)


# With megatron's small init a tiny model predicts a near-uniform next token (logits ~0.1) and its
# experts write almost nothing into the residual stream, so which expert a token visits would not
# move its log-prob. Trained MoE models are the opposite: peaked predictions, experts that matter.
# Scaling the experts and the output layer gives the tiny model that shape.
SCALES = {".experts.": 8.0, "output_layer.": 4.0}


@torch.no_grad()
def _amplify(chunks: list[torch.nn.Module]) -> None:
    for c in chunks:
        for name, p in c.named_parameters():
            for key, scale in SCALES.items():
                if key in name:
                    p.mul_(scale)


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def _load_engine_weights(src: list[torch.nn.Module], dst: list[torch.nn.Module]) -> None:
    """The engine holds the trainer's weights rounded to bf16, as an inference engine loads them
    (its activations stay fp32 here: full bf16 compute on a 64-wide CPU model drowns the
    routing effect in logit noise, which is not what real engines look like)."""
    with torch.no_grad():
        for a, b in zip(src, dst):
            for pa, pb in zip(a.parameters(), b.parameters()):
                pb.copy_(pa.to(torch.bfloat16).to(pb.dtype))


def _state(chunks) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in c.state_dict().items() if isinstance(v, torch.Tensor)} for c in chunks]


def _install(step, inner, routes_of, ids_of):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        step.install(model, routes_of.get(id(batch)), batch.seq_lens,
                     cu_seqlens_padded=batch.cu_seqlens_padded, sample_ids=ids_of[id(batch)])
        return inner(iter([batch]), model)
    return forward_step


def _as_rollout(recorded: ReplayBatch) -> ReplayBatch:
    """Engine convention: no row for the last token of each sequence."""
    seqs = [recorded.sequence(i)[0][:-1] for i in range(recorded.num_seqs)]
    return ReplayBatch.from_ragged(seqs, num_experts=recorded.num_experts, layer_ids=recorded.layer_ids,
                                   source="rollout")


def run_demo(ctx: RankContext, opts: DemoOptions) -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    spec = demo_spec(ctx.cp)
    trainer = [c.to(opts.device) for c in build_model_chunks(spec, ctx)]
    _amplify(trainer)
    engine = [c.to(opts.device) for c in build_model_chunks(spec, ctx)]
    for c in engine:
        c.eval()
    rep = Replayer(trainer)
    eng = Replayer(engine, agreement=False)
    layout = rep.layout
    thd = spec.attention == "identity"
    fwd = make_forward_step(ctx, thd=thd)
    fwd_logits = make_forward_step(ctx, thd=thd, collect_logits=True)
    align = align_for(ctx.tp, ctx.cp)
    last_stage = ctx.is_last_stage
    lineage = {m: _state(trainer) for m in opts.modes}
    num_layers = layout.num_layers
    out: dict[str, Any] = {}
    per_mode = {m: dict(agree=torch.zeros(num_layers), total=torch.zeros(num_layers),
                        sums=None, cov=[], native=[]) for m in opts.modes}
    g = torch.Generator().manual_seed(opts.seed)
    for step_i in range(opts.steps):
        n = opts.seqs_per_step
        lens = torch.randint(opts.min_len, opts.max_len + 1, (n,), generator=g).tolist()
        per_update = _micro_batches_per_update(ctx.pp, ctx.vpp)
        n_groups = _mini_batches(opts, ctx.pp, ctx.vpp) * per_update
        per_mb = n // n_groups
        groups = [lens[i * per_mb:(i + 1) * per_mb] for i in range(n_groups)]
        pad_to = max(sum(-(-x // align) * align for x in grp) for grp in groups)
        batches = [batch_to(make_packed_batch(grp, spec.vocab_size, 1000 * step_i + i + opts.seed, align=align,
                                              pad_to=pad_to), opts.device) for i, grp in enumerate(groups)]
        ids_of, start = {}, 0
        for b in batches:
            ids_of[id(b)] = list(range(start, start + len(b.seq_lens)))
            start += len(b.seq_lens)
        for mode in opts.modes:
            for c, st in zip(trainer, lineage[mode]):
                c.load_state_dict(st, strict=False)
            _load_engine_weights(trainer, engine)
            # 1. rollout engine (bf16): log-probs and routes
            with eng.step("record", forward_only=True) as es:
                res = run_schedule(engine, batches, _install(es, fwd_logits, {}, ids_of), forward_only=True)
            rollout = _as_rollout(es.recorded)
            rollout_lp = [_logprobs(r.logits, b.labels) for r, b in zip(res, batches)] if last_stage else []
            roll_of = {id(b): rollout.select(ids_of[id(b)]) for b in batches}
            # 2. compute_log_prob (theta_old)
            plan = phase_plan(mode, Phase.OLD_LOG_PROB)
            for c in trainer:
                c.eval()
            with rep.step(plan.action, forward_only=True, source=plan.source) as ls:
                run_schedule(trainer, batches, _install(ls, fwd, roll_of if plan.source else {}, ids_of),
                             forward_only=True)
            recorded = ls.recorded
            for c in trainer:
                c.train()
            # 3. updates, one SGD step per mini-batch
            plan = phase_plan(mode, Phase.UPDATE)
            if plan.source == "recorded":
                ref_of = {id(b): recorded.select(ids_of[id(b)]) for b in batches}
            else:
                ref_of = roll_of
            opt = torch.optim.SGD([p for c in trainer for p in c.parameters()], lr=opts.lr)
            pm = per_mode[mode]
            for u in range(0, len(batches), per_update):
                mini = batches[u:u + per_update]
                opt.zero_grad(set_to_none=True)
                with RoutingProbe(trainer, include_mtp=False) as probe:
                    with rep.step(plan.action, forward_only=False, source=plan.source) as us:
                        res = run_schedule(trainer, mini, _install(us, fwd_logits, ref_of if plan.source else {}, ids_of),
                                           forward_only=False)
                _sync_grads(trainer, ctx)
                opt.step()
                pm["cov"].append(us.metrics.get("r3bridge/coverage", 0.0))
                if plan.source:
                    pm["native"].append(us.metrics.get("r3bridge/agreement/mean", 0.0))
                _count_agreement(probe, mini, ref_of, layout, ctx, pm)
                if last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0:
                    for j, b in enumerate(mini):
                        train_lp = _logprobs(res[j].logits, b.labels)
                        # the loss mask already drops each sequence's last token (it has no label
                        # and no rollout log-prob): nothing more to exclude
                        sums = logprob_mismatch_sums(train_lp.cpu(), rollout_lp[u + j].cpu(), b.loss_mask.bool().cpu(),
                                                     cu_seqlens=b.cu_seqlens_padded.cpu(), exclude_last=False)
                        pm["sums"] = sums if pm["sums"] is None else pm["sums"] + sums
            lineage[mode] = _state(trainer)
            if opts.verbose and ctx.rank == 0:
                print(f"[r3bridge demo] step {step_i + 1}/{opts.steps} mode {mode} done", file=sys.stderr, flush=True)
    for mode, pm in per_mode.items():
        out[mode] = {"agree": pm["agree"].tolist(), "total": pm["total"].tolist(),
                     "mismatch": mismatch_from_sums(pm["sums"], prefix="") if pm["sums"] is not None else None,
                     "coverage": sum(pm["cov"]) / len(pm["cov"]) if pm["cov"] else 0.0,
                     "native_agreement": sum(pm["native"]) / len(pm["native"]) if pm["native"] else None}
    out["rank"] = dict(pp=ctx.pp_rank, tp=ctx.tp_rank, cp=ctx.cp_rank, last=last_stage)
    return out


def _sync_grads(chunks, ctx: RankContext) -> None:
    from r3bridge.testing.schedule import sync_grads
    sync_grads(chunks, ctx)


def _count_agreement(probe: RoutingProbe, batches: list, ref_of: dict, layout, ctx: RankContext, pm) -> None:
    """Trainer's dispatched top-k vs the reference routes on rows that have a reference route.
    Per layer, the router calls of one schedule run come in micro-batch order (the forward; a
    recompute, identical by construction, would come later)."""
    by_layer: dict[int, list] = {}
    for call in probe.calls:
        if call.grad_enabled:
            by_layer.setdefault(call.layer_id, []).append(call)
    for lid, calls in by_layer.items():
        for b, call in zip(batches, calls):
            t = shard(ref_of[id(b)], layout, b.seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                      cu_seqlens_padded=b.cu_seqlens_padded, layer_ids=[lid])
            got = call.topk().cpu()
            same = (got.sort(1).values == t.indices[lid].sort(1).values).all(1) & t.valid
            pm["agree"][lid] += float(same.sum())
            pm["total"][lid] += float(t.valid.sum())
