"""Conformance suite for framework adapters (see r3bridge.protocols and docs/porting.md).

An adapter passes when, for canonical rollouts (random routes, dense-first layers, multi-turn
calls whose later prefill re-routes earlier tokens differently, resubmits, untracked tails):

Ingest level (no Megatron):

1. ``check_ingest``: the framework's own batch built from the rollout's engine outputs, read back
   with ``codec.to_replay_batch``, equals the canonical ReplayBatch byte for byte;
2. ``check_recorded_survives_split``: R2 routes written into the batch with
   ``codec.write_recorded`` come back exactly, sample for sample, from every part of the
   framework's own re-partitioning (``codec.split``), also after a permutation of the batch;
3. ``check_same_targets``: several ReplayBatches (e.g. one per framework) give identical per-rank
   targets (``r3bridge.shard``) for a set of parallel layouts.

Megatron level (CPU harness, inside ``r3bridge.testing.dist.spawn``):

4. ``megatron_r3_check``: the adapter's per-micro-batch hook, driven by the framework's real
   schedule code on harness model chunks, makes every router call dispatch exactly the rollout's
   routes on valid rows (checked under a ``RoutingProbe`` against ``r3bridge.shard`` of the
   canonical batch with the packing metadata the framework really used);
5. ``megatron_r2_check``: R2 recorded by the adapter, written back, re-partitioned differently
   and replayed, reproduces the recording pass's log-probs and native choices (agreement 1.0).

The Megatron-level checks take a :class:`MegatronRunner` (what the adapter's test supplies: how
to run one framework pass on harness chunks). Everything returns plain data or raises
``AssertionError`` with a message naming sample, row and layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

from r3bridge.canonical import canonical_form, with_empty_sequences
from r3bridge.ingest import stitch
from r3bridge.layout import ParallelLayout
from r3bridge.protocols import BatchCodec
from r3bridge.schema import ReplayBatch
from r3bridge.sharding import shard

__all__ = ["CanonicalRollout", "make_rollout", "check_ingest", "check_recorded_survives_split",
           "check_same_targets", "default_layouts", "MegatronRunner", "megatron_r3_check", "megatron_r2_check",
           "assert_same_batch"]


@dataclass
class CanonicalRollout:
    """What the inference engine did for a batch of samples.

    ``calls[i][t]``: the all-layers routes ``[rows, num_layers, K]`` (dense layers zero) engine call
    ``t`` of sample ``i`` returned, from row 0 of that call's prompt (every call re-sends the whole
    context: multi-turn prefill and resubmits); ``call_tokens[i][t]`` the call's prompt + output.
    ``tokens[i]``: the sample's final trajectory (what the trainer sees)."""

    tokens: list[list[int]]
    calls: list[list[np.ndarray]]
    call_tokens: list[list[list[int]]]
    prompt_lens: list[int]
    call_prompt_lens: list[list[int]]           # prompt length of each call (resubmit: prompt == previous call's tokens)
    num_experts: int
    num_layers: int
    moe_layer_ids: list[int]
    topk: int

    @property
    def batch_size(self) -> int:
        return len(self.tokens)

    def expected(self) -> ReplayBatch:
        """The canonical ReplayBatch: first-seen rows, MoE layers, one row per token (invalid where
        no call routed it), a final row without a route dropped; source ``"rollout"``."""
        per = []
        for i in range(self.batch_size):
            pieces = [ReplayBatch.from_ragged([c[:, self.moe_layer_ids]], num_experts=self.num_experts,
                                              layer_ids=self.moe_layer_ids, source="rollout")
                      for c in self.calls[i]]
            rb, _ = stitch(pieces)
            per.append(canonical_form(rb, [len(self.tokens[i])]))
        return ReplayBatch.concat(per)

    def response_lens(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lens)]


def _routes(rng: np.random.Generator, rows: int, num_layers: int, moe: Sequence[int], e: int, k: int,
            dtype=np.uint8) -> np.ndarray:
    out = np.zeros((rows, num_layers, k), dtype=dtype)
    if rows:
        scores = rng.random((rows, len(moe), e))
        out[:, list(moe)] = np.argsort(-scores, axis=-1)[..., :k].astype(dtype)
    return out


def make_rollout(seed: int = 0, *, batch_size: int = 5, num_experts: int = 8, topk: int = 2,
                 num_layers: int = 4, moe_layer_ids: Sequence[int] = (1, 2, 3), vocab: int = 100,
                 max_prompt: int = 9, max_turns: int = 3, dtype=np.uint8) -> CanonicalRollout:
    """Random rollouts covering single-turn, multi-turn (each later call re-routes the earlier
    context *differently*: only first-seen rows are right), resubmits (a call repeated over the
    same context) and final tokens no call routed (observations appended after the last call)."""
    rng = np.random.default_rng(seed)
    moe = list(moe_layer_ids)
    tokens, calls, call_tokens, plens, call_plens = [], [], [], [], []
    for i in range(batch_size):
        p = int(rng.integers(2, max_prompt + 1))
        ctx = list(rng.integers(1, vocab, size=p))
        plens.append(p)
        sample_calls, sample_call_tokens, sample_plens = [], [], []
        turns = 1 if i == 0 else int(rng.integers(1, max_turns + 1))
        for t in range(turns):
            gen = list(rng.integers(1, vocab, size=int(rng.integers(1, 6))))
            full = ctx + gen
            sample_calls.append(_routes(rng, len(full) - 1, num_layers, moe, num_experts, topk, dtype))
            sample_call_tokens.append(list(full))
            sample_plens.append(len(ctx))
            if i % 3 == 2 and t == 0:       # a resubmit of the same request: the prefix comes back again
                again = full + list(rng.integers(1, vocab, size=2))
                sample_calls.append(_routes(rng, len(again) - 1, num_layers, moe, num_experts, topk, dtype))
                sample_call_tokens.append(list(again))
                sample_plens.append(len(full))
                full = again
            ctx = list(full)
            if t < turns - 1 or i % 2:      # an observation / tail the engine never routes
                ctx += list(rng.integers(1, vocab, size=int(rng.integers(1, 4))))
        tokens.append([int(x) for x in ctx])
        calls.append(sample_calls)
        call_tokens.append([[int(x) for x in c] for c in sample_call_tokens])
        call_plens.append(sample_plens)
    return CanonicalRollout(tokens, calls, call_tokens, plens, call_plens, num_experts, num_layers, moe, topk)


def assert_same_batch(got: ReplayBatch, want: ReplayBatch, what: str = "") -> None:
    """Byte-identical, with a message naming the first difference."""
    if got.to_bytes() == want.to_bytes():
        return
    msg = [f"{what}: ReplayBatches differ"]
    for name in ("source", "layer_ids", "num_experts", "topk", "rows_per_seq", "start_rows"):
        a, b = getattr(got, name), getattr(want, name)
        if a != b:
            msg.append(f"{name}: got {a!r}, want {b!r}")
    if got.rows_per_seq == want.rows_per_seq:
        for i in range(got.num_seqs):
            ra, va = got.sequence(i)
            rb_, vb = want.sequence(i)
            if not torch.equal(va, vb):
                r = int((va != vb).nonzero()[0])
                msg.append(f"sample {i}, row {r}: valid {bool(va[r])} vs {bool(vb[r])}")
                break
            if not torch.equal(ra, rb_):
                r, l = (ra != rb_).any(-1).nonzero()[0].tolist()
                msg.append(f"sample {i}, row {r}, layer {got.layer_ids[l]}: {ra[r, l].tolist()} vs {rb_[r, l].tolist()}")
                break
    raise AssertionError("; ".join(msg))


def check_ingest(codec: BatchCodec, native: Any, rollout: CanonicalRollout, what: str = "") -> ReplayBatch:
    """(1) the native batch carries exactly the canonical routes."""
    got = codec.to_replay_batch(native, source="rollout")
    assert_same_batch(got, rollout.expected(), what or type(codec).__name__)
    lens = codec.seq_lens(native)
    assert lens == [len(t) for t in rollout.tokens], f"seq_lens {lens} != trajectory lengths"
    return got


def check_recorded_survives_split(codec: BatchCodec, native: Any, recorded: ReplayBatch,
                                  parts: Sequence[int] = (1, 2, 3), orders: Sequence[Optional[list[int]]] = (None,)
                                  ) -> int:
    """(2) R2 routes written back survive the framework's re-partitioning. Returns parts checked."""
    native = codec.write_recorded(native, recorded)
    whole = codec.to_replay_batch(native, source="recorded")
    assert_same_batch(whole, recorded, "recorded routes read back from the whole batch")
    n = 0
    for order in orders:
        for p in parts:
            kw = {} if order is None else {"order": order}
            for part, ids in codec.split(native, p, **kw):
                got = codec.to_replay_batch(part, source="recorded")
                assert_same_batch(got, recorded.select(ids), f"part of a {p}-way split (samples {ids})")
                n += 1
    return n


def default_layouts() -> list[tuple[ParallelLayout, list[tuple[int, int, int, int]]]]:
    """(layout, rank keys) pairs: TP+SP, CP zigzag, PP with a dense first stage, VPP."""
    out = []
    for lay in (ParallelLayout(4, [0, 1, 1, 1], tp=2), ParallelLayout(4, [0, 1, 1, 1], cp=2),
                ParallelLayout(4, [0, 1, 1, 1], tp=2, cp=2, pp=2),
                ParallelLayout(4, [0, 1, 1, 1], pp=2, vpp=2),
                ParallelLayout(4, [0, 1, 1, 1], num_layers_in_first_pipeline_stage=1, pp=2)):
        keys = [(t, c, p, v) for t in range(lay.tp) for c in range(lay.cp) for p in range(lay.pp)
                for v in range(lay.vp_size)]
        out.append((lay, keys))
    return out


def check_same_targets(batches: dict[str, ReplayBatch], seq_lens: Sequence[int], layouts=None) -> int:
    """(3) identical per-rank targets from every batch. Returns the number of rank targets compared."""
    names = list(batches)
    n = 0
    for lay, keys in (layouts or default_layouts()):
        for (t, c, p, v) in keys:
            ref = None
            for name in names:
                tg = shard(batches[name], lay, seq_lens, tp_rank=t, cp_rank=c, pp_rank=p, vp_stage=v)
                if ref is None:
                    ref = (name, tg)
                    continue
                assert torch.equal(tg.valid, ref[1].valid), f"{name} vs {ref[0]}: validity differs on {lay} rank {(t, c, p, v)}"
                assert tg.layer_ids == ref[1].layer_ids
                for lid in tg.layer_ids:
                    assert torch.equal(tg.indices[lid], ref[1].indices[lid]), (
                        f"{name} vs {ref[0]}: layer {lid} targets differ on rank (tp,cp,pp,vp)={(t, c, p, v)}")
                n += 1
    return n


# ---------------------------------------------------------------------------------- Megatron level
class MegatronRunner(Protocol):
    """What an adapter's test supplies to run one framework pass on harness chunks."""

    def attach(self, ctx: Any, chunks: list, mode: str) -> Any:
        """Build the framework object around ``chunks`` with ``replay_mode=mode``."""
        ...

    def micro_batches(self, rollout: CanonicalRollout, groups: Sequence[Sequence[int]], *, key: str) -> list:
        """Native micro-batches holding samples ``groups[m]`` (``key``: "rollout" or "recorded")."""
        ...

    def run(self, obj: Any, micro_batches: list, *, phase: str) -> dict:
        """One pass (``phase``: "compute_log_prob" or "update"); returns ``{"logprobs": [per-sample
        tensors], "metrics": {...}, "recorded": ReplayBatch | None, "packing": [per micro-batch
        dict(seq_lens=..., cu_seqlens_padded=..., format=..., seq_length=..., samples=...)]}``
        (``samples``: rollout sample of each sequence, when the framework re-partitions itself)."""
        ...

    def write_recorded(self, rollout: CanonicalRollout, recorded: ReplayBatch) -> None:
        """Keep ``recorded`` (sample order) for later ``micro_batches(..., key="recorded")``."""
        ...


def megatron_r3_check(ctx: Any, runner: MegatronRunner, rollout: CanonicalRollout, groups, chunks: list) -> dict:
    """(4) every router call of an R3 pass dispatches the canonical routes on valid rows."""
    from r3bridge.testing.probe import RoutingProbe

    obj = runner.attach(ctx, chunks, "R3")
    mbs = runner.micro_batches(rollout, groups, key="rollout")
    with RoutingProbe(chunks, include_mtp=False) as probe:
        res = runner.run(obj, mbs, phase="compute_log_prob")
    expected = rollout.expected()
    layout = obj.replayer.layout if hasattr(obj, "replayer") else ParallelLayout.from_megatron(chunks[0].config)
    errors, checked = [], 0
    by_layer: dict[int, list] = {}
    for call in probe.calls:
        by_layer.setdefault(call.layer_id, []).append(call)
    for lid, calls in by_layer.items():
        if len(calls) != len(groups):
            errors.append(f"layer {lid}: {len(calls)} router calls for {len(groups)} micro-batches")
            continue
        for m, (call, g) in enumerate(zip(calls, groups)):
            pk = dict(res["packing"][m])
            seq_lens = pk.pop("seq_lens")
            g = pk.pop("samples", g)          # frameworks that re-balance micro-batches report their own
            routes = expected.select(list(g))
            if len(seq_lens) > len(g):        # framework padding "sequences" (no routes)
                routes = with_empty_sequences(routes, seq_lens[len(g):])
            tg = shard(routes, layout, seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank, pp_rank=ctx.pp_rank,
                       vp_stage=call.chunk, layer_ids=[lid], **pk)
            got = call.topk()
            want = tg.indices[lid].sort(dim=1).values
            v = tg.valid
            if got.shape != want.shape:
                errors.append(f"layer {lid} micro-batch {m}: router saw {tuple(got.shape)} rows, targets {tuple(want.shape)}")
            elif not torch.equal(got[v], want[v]):
                errors.append(f"layer {lid} micro-batch {m}: {int((got[v] != want[v]).any(1).sum())} valid rows differ")
            checked += int(v.sum())
    return {"errors": errors, "checked_rows": checked, "metrics": res["metrics"]}


def megatron_r2_check(ctx: Any, runner: MegatronRunner, rollout: CanonicalRollout, record_groups, replay_groups,
                      chunks: list) -> dict:
    """(5) record under R2, write back, replay re-partitioned: same log-probs, agreement 1.0."""
    obj = runner.attach(ctx, chunks, "R2")
    rec_res = runner.run(obj, runner.micro_batches(rollout, record_groups, key=None), phase="compute_log_prob")
    recorded = rec_res["recorded"]
    runner.write_recorded(rollout, recorded)
    rep_res = runner.run(obj, runner.micro_batches(rollout, replay_groups, key="recorded"), phase="update")
    order_rec = [i for g in record_groups for i in g]
    order_rep = [i for g in replay_groups for i in g]
    lp_rec = {i: lp for i, lp in zip(order_rec, rec_res["logprobs"])}
    lp_rep = {i: lp for i, lp in zip(order_rep, rep_res["logprobs"])}
    diffs = [float((lp_rec[i] - lp_rep[i]).abs().max()) for i in lp_rec if lp_rep.get(i) is not None]
    return {"recorded_rows": None if recorded is None else recorded.rows_per_seq,
            "max_logprob_diff": max(diffs) if diffs else None,
            "agreement": rep_res["metrics"].get("r3bridge/agreement/mean"), "metrics": rep_res["metrics"],
            # what the adapter hands to the framework's own metrics logging, if it says (optional)
            "framework_metrics": rep_res.get("framework_metrics")}
