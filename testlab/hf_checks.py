"""Rank functions (for :func:`r3bridge.testing.harness.dist.spawn`) checking R3 with the HF engine.

* :func:`equivalence_rank`: the converted megatron model computes what the HF model computes
  (log-probs on the same tokens, native top-k sets, router settings);
* :func:`r3_rank`: R3 with the engine's routes, through ``ReplayBatch.from_vllm`` /
  ``from_sglang`` and ``r3bridge.stitch`` only, on a rollout with batched prompts of different
  lengths, a multi-turn sample, an aborted-and-resubmitted request and a sample whose tail no
  engine call routed.

Everything returned is plain data; the tests assert on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.demo.hf_engine import HFEngine, build_hf_model, tiny_qwen3_moe_config
from r3bridge.demo.hf_to_mcore import hf_to_mcore, packed_from_tokens, router_settings, spec_from_hf, zero_attention
from r3bridge.metrics import logprob_mismatch_sums, mismatch_from_sums
from r3bridge.parallel.sharding import shard
from r3bridge.rollout.stitching import stitch
from r3bridge.testing.harness.dist import RankContext
from r3bridge.testing.harness.models import build_model_chunks, load_reference_state
from r3bridge.testing.harness.probe import RoutingProbe

__all__ = ["EngineCase", "engine_models", "equivalence_rank", "r3_rank", "Rollout", "run_rollout"]


@dataclass(frozen=True)
class EngineCase:
    attention: str = "real"          # "identity": MoE-only layers (CP on CPU)
    seed: int = 7
    engine_bf16_weights: bool = True  # the engine loads bf16-rounded weights, as serving engines do


def engine_models(case: EngineCase) -> tuple[HFEngine, dict[str, torch.Tensor], Any]:
    """(engine, the trainer's fp32 HF state, HF config): the engine holds the same weights rounded
    to bf16 (its numerics differ from the trainer's, as a real engine's do)."""
    cfg = tiny_qwen3_moe_config()
    model = build_hf_model(cfg, seed=case.seed)
    if case.attention == "identity":
        zero_attention(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if case.engine_bf16_weights:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    return HFEngine(model), state, cfg


def _trainer(ctx: RankContext, cfg: Any, state: dict[str, torch.Tensor], attention: str) -> list[torch.nn.Module]:
    chunks = build_model_chunks(spec_from_hf(cfg, attention=attention), ctx)
    load_reference_state(chunks, hf_to_mcore(state, cfg, attention=attention), ctx)
    return chunks


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, tokens: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """HF forward over one sequence: log-probs of tokens 1.. and each MoE layer's top-k."""
    from r3bridge.demo.hf_engine import _RouteRecorder
    from r3bridge.hf import moe_layer_ids_from_hf_config

    rec = _RouteRecorder(model, moe_layer_ids_from_hf_config(model.config))
    try:
        ids = torch.as_tensor([list(tokens)])
        logits = model(input_ids=ids).logits[0].float()
    finally:
        rec.remove()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp, {lid: c[0] for lid, c in rec.calls.items()}


def equivalence_rank(ctx: RankContext, attention: str = "auto") -> dict[str, Any]:
    """Same weights, same tokens: HF (fp32) vs the converted megatron model (fp32, this layout)."""
    if attention == "auto":
        attention = "identity" if ctx.cp > 1 else "real"
    from r3bridge.testing.harness.data import align_for
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    case = EngineCase(attention=attention, engine_bf16_weights=False)
    engine, state, cfg = engine_models(case)
    chunks = _trainer(ctx, cfg, state, attention)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (37, 64, 21, 50)]
    groups = [seqs[:2], seqs[2:]]     # two micro-batches: the interleaved schedule needs >= pp
    align = align_for(ctx.tp, ctx.cp)
    pad_to = max(sum(-(-len(s) // align) * align for s in grp) for grp in groups)
    batches = [packed_from_tokens(grp, align=align, pad_to=pad_to) for grp in groups]
    fwd = make_forward_step(ctx, thd=attention == "identity", collect_logits=True)
    for c in chunks:
        c.eval()
    with RoutingProbe(chunks, include_mtp=False) as probe:
        res = run_schedule(chunks, batches, fwd, forward_only=True)
    out: dict[str, Any] = {"router": router_settings(chunks[0].config), "topk_same": {}, "topk_total": {}}
    layout = _layout(chunks, ctx)
    diffs, scale = [], []
    calls: dict[int, list] = {}
    for call in probe.calls:
        calls.setdefault(call.layer_id, []).append(call)
    for m, (grp, batch) in enumerate(zip(groups, batches)):
        ref = [hf_logprobs(engine.model, s) for s in grp]
        # HF's native top-k sets of these tokens, sharded like the trainer's rows
        hf_routes = ReplayBatch.from_ragged([torch.stack([r[1][l] for l in engine.moe_layer_ids], 1) for r in ref],
                                            num_experts=engine.num_experts, layer_ids=engine.moe_layer_ids)
        for lid, lcalls in calls.items():
            t = shard(hf_routes, layout, batch.seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                      cu_seqlens_padded=batch.cu_seqlens_padded, layer_ids=[lid])
            same = (lcalls[m].topk().sort(1).values == t.indices[lid].sort(1).values).all(1) & t.valid
            out["topk_same"][lid] = out["topk_same"].get(lid, 0) + int(same.sum())
            out["topk_total"][lid] = out["topk_total"].get(lid, 0) + int(t.valid.sum())
        if res:
            lp = _logprobs(res[m].logits, batch.labels)
            for i, s in enumerate(grp):
                off = int(batch.cu_seqlens_padded[i])
                diffs.append((lp[off:off + len(s) - 1] - ref[i][0]).abs())
                scale.append(ref[i][0].abs())
    if res:
        out["max_abs_logprob_diff"] = float(torch.cat(diffs).max())
        out["mean_abs_logprob"] = float(torch.cat(scale).mean())
    return out


def _layout(chunks, ctx):
    from r3bridge.megatron import Replayer

    return Replayer(chunks, agreement=False).layout


# --------------------------------------------------------------------------------------------
# The rollout: what the engine did, and what the trainer side builds from it
# --------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    tokens: list[list[int]]            # final trajectories (what the trainer sees)
    engine_logprobs: list[torch.Tensor]  # [n_i - 1]: engine log-prob of token j + 1 (0 where untrained)
    trained: list[torch.Tensor]        # [n_i - 1] bool: token j + 1 is a sampled response token
    routes: ReplayBatch                # stitched + canonical: one row per token but the last
    kinds: list[str]
    stitch_overlap: int = 0
    stitch_disagreeing: int = 0


KINDS = ("single", "single", "single", "multi_turn", "resubmit", "untracked_tail")


def run_rollout(engine: HFEngine, *, seed: int = 0) -> Rollout:
    """Six samples, all from real ``generate()`` calls (two batched rounds):

    * ``single`` x3: one call; prompts of different lengths batched with left padding;
    * ``multi_turn``: call 1; an observation is appended; call 2 re-sends everything (its prefill
      re-routes the turn-1 tokens: first-seen rows win in the stitch);
    * ``resubmit``: call 1 is aborted after 3 tokens and resubmitted with its partial output as
      the prompt; the engine returns the whole prefix again (deduplicated by the stitch);
    * ``untracked_tail``: one call, then tokens no engine call ever routed (an observation after
      the last turn, or a turn whose call was aborted without routes): the rows end before the
      tokens do; those tokens get invalid rows and are routed natively.

    Round 1 reaches the trainer through SGLang's base64 ``meta_info``, round 2 through vLLM's
    arrays; both only through ``ReplayBatch.from_sglang`` / ``from_vllm`` and ``stitch``."""
    from r3bridge.batch.canonical import canonical_form

    g = np.random.default_rng(seed)
    vocab = int(engine.model.config.vocab_size)
    prompts = [g.integers(1, vocab, size=n).tolist() for n in (9, 30, 17, 12, 20, 14)]
    first = engine.generate(prompts, max_new_tokens=[24, 11, 40, 16, 3, 20], seed=seed)
    tokens = [c.tokens for c in first]
    lp = [[0.0] * (len(p) - 1) + c.logprobs for p, c in zip(prompts, first)]
    tr = [[False] * (len(p) - 1) + [True] * len(c.output_ids) for p, c in zip(prompts, first)]
    obs = {3: g.integers(1, vocab, size=5).tolist(), 5: g.integers(1, vocab, size=6).tolist()}
    again = {3: tokens[3] + obs[3], 4: list(tokens[4])}
    second = dict(zip(again, engine.generate(list(again.values()), max_new_tokens=[14, 18], seed=seed + 1)))
    for i, extra in obs.items():
        tokens[i] = tokens[i] + extra
        lp[i] += [0.0] * len(extra)
        tr[i] += [False] * len(extra)
    for i, c in second.items():
        tokens[i] = c.tokens
        lp[i] += c.logprobs
        tr[i] += [True] * len(c.output_ids)
    L, K, E, moe = engine.num_layers, engine.topk, engine.num_experts, engine.moe_layer_ids
    p1 = ReplayBatch.from_sglang([c.meta_info() for c in first], num_experts=E, num_layers=L, topk=K,
                                 moe_layer_ids=moe)
    none = np.zeros((0, L, K), dtype=np.uint8)
    p2 = ReplayBatch.from_vllm([second[i].routed_experts if i in second else none for i in range(len(prompts))],
                               num_experts=E, moe_layer_ids=moe)
    rb, report = stitch([p1, p2])
    routes = canonical_form(rb, [len(t) for t in tokens])
    return Rollout(tokens, [torch.tensor(x) for x in lp], [torch.tensor(x) for x in tr], routes, list(KINDS),
                   sum(report.overlap_rows), report.total_disagreeing)


GROUPS = ((0, 3, 4), (1, 2, 5))   # two micro-batches, each with a special sample


def _batches(ro: Rollout, ctx: RankContext) -> tuple[list, list]:
    from r3bridge.testing.harness.data import align_for

    align = align_for(ctx.tp, ctx.cp)
    pad_to = max(sum(-(-len(ro.tokens[i]) // align) * align for i in grp) for grp in GROUPS)
    batches, rollout_lp = [], []
    for grp in GROUPS:
        b = packed_from_tokens([ro.tokens[i] for i in grp], align=align, pad_to=pad_to)
        lp = torch.zeros(b.total)
        b.loss_mask.zero_()
        for j, i in enumerate(grp):
            off = int(b.cu_seqlens_padded[j])
            n = len(ro.tokens[i]) - 1
            b.loss_mask[off:off + n] = ro.trained[i].float()
            lp[off:off + n] = ro.engine_logprobs[i]
        batches.append(b)
        rollout_lp.append(lp)
    return batches, rollout_lp


def r3_rank(ctx: RankContext, attention: str = "auto") -> dict[str, Any]:
    """off, then R3, each one training forward + backward of both micro-batches (no optimizer
    step, so both see the same weights). Per mode: trainer-vs-engine route agreement on valid
    rows (RoutingProbe vs ``shard`` of the rollout routes), the driver's metrics, and the
    train-vs-engine log-prob mismatch over the sampled response tokens."""
    from r3bridge.megatron import Replayer
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    if attention == "auto":   # CP on CPU needs MoE-only layers (no local CP attention)
        attention = "identity" if ctx.cp > 1 else "real"
    engine, state, cfg = engine_models(EngineCase(attention=attention))
    ro = run_rollout(engine)
    chunks = _trainer(ctx, cfg, state, attention)
    rep = Replayer(chunks)
    layout = rep.layout
    batches, rollout_lp = _batches(ro, ctx)
    routes_of = {id(b): ro.routes.select(list(grp)) for b, grp in zip(batches, GROUPS)}
    inner = make_forward_step(ctx, thd=attention == "identity", collect_logits=True)
    out: dict[str, Any] = {"stitch_overlap": ro.stitch_overlap, "stitch_disagreeing": ro.stitch_disagreeing,
                           "valid_rows": int(ro.routes.valid.sum()), "rows": ro.routes.total_rows,
                           "rows_per_seq": list(ro.routes.rows_per_seq), "seq_lens": [len(t) for t in ro.tokens]}
    for mode, action in (("off", "native"), ("R3", "replay")):
        def fwd(data_iterator, model, _step=None, _action=action):
            batch = next(data_iterator)
            st.install(model, routes_of[id(batch)] if _action == "replay" else None, batch.seq_lens,
                       cu_seqlens_padded=batch.cu_seqlens_padded)
            return inner(iter([batch]), model)

        for c in chunks:
            c.train()
            c.zero_grad(set_to_none=True)
        with RoutingProbe(chunks, include_mtp=False) as probe:
            with rep.open_pass(action, forward_only=False, route_kind="rollout" if action == "replay" else None) as st:
                res = run_schedule(chunks, batches, fwd, forward_only=False)
        same = total = mismatched_rows = 0
        calls = [c for c in probe.calls if c.grad_enabled]
        by_layer: dict[int, list] = {}
        for c in calls:
            by_layer.setdefault(c.layer_id, []).append(c)
        for lid, lcalls in by_layer.items():
            for b, call in zip(batches, lcalls):
                t = shard(routes_of[id(b)], layout, b.seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                          cu_seqlens_padded=b.cu_seqlens_padded, layer_ids=[lid])
                eq = (call.topk().sort(1).values == t.indices[lid].sort(1).values).all(1)
                same += int((eq & t.valid).sum())
                total += int(t.valid.sum())
                mismatched_rows += int((~eq & t.valid).sum())
        m: dict[str, Any] = {"agree": same, "total": total, "mismatched_rows": mismatched_rows,
                             "router_calls": len(calls), "metrics": dict(st.metrics)}
        if res:
            sums = None
            for r, b, lp in zip(res, batches, rollout_lp):
                train = _logprobs(r.logits, b.labels)
                s = logprob_mismatch_sums(train, lp, b.loss_mask.bool(), cu_seqlens=b.cu_seqlens_padded,
                                          exclude_last=False)
                sums = s if sums is None else sums + s
            m["mismatch"] = mismatch_from_sums(sums, prefix="")
        out[mode] = m
    return out


def conformance_rank(ctx: RankContext) -> dict[str, Any]:
    """Both checks under one layout (one process start serves both)."""
    return {"equivalence": equivalence_rank(ctx), "r3": r3_rank(ctx)}
