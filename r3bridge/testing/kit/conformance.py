"""Conformance checks 1-5 for framework adapters (r3bridge.protocols, docs/porting.md): they pass
or fail.

This module and :mod:`r3bridge.testing.kit.suite` (the same checks as pytest base classes) are
intended for adapters that live anywhere, in r3bridge's tree or in a framework's own repository,
to subclass and call. Their names, the fixtures the base classes ask for and the thresholds are a
promise: moving or renaming them, or loosening a threshold, is not done lightly.

An adapter passes when, for canonical rollouts (random routes, dense layers where the model has
them, multi-turn calls whose later prefill re-routes earlier tokens differently, resubmits,
untracked tails, aborted samples whose engine call returned no routes):

Ingest level (no Megatron):

1. :func:`check_ingest`: the framework's own batch built from the rollout's engine outputs, read
   back with ``codec.to_replay_batch``, equals the canonical ReplayBatch byte for byte;
2. :func:`check_recorded_survives_split`: R2 routes written into the batch with
   ``codec.write_recorded`` come back exactly, sample for sample, from every part of the
   framework's own re-partitioning (``codec.split``), also after a permutation of the batch;
3. :func:`check_same_targets`: several ReplayBatches (the adapter's and the canonical one) give
   identical per-rank targets (``r3bridge.shard``) for a set of parallel layouts.

Megatron level (CPU harness, inside ``r3bridge.testing.harness.dist.spawn_layouts``), through a
:class:`~r3bridge.testing.kit.runner.MegatronRunner` (the runner contract, documented there):

4. :func:`megatron_r3_check`: the adapter's per-micro-batch hook, driven by the framework's real
   phase method (compute_log_prob, the adapter's override in front) and schedule code on harness
   model chunks, makes every router call dispatch exactly the rollout's
   routes on valid rows (checked under a ``RoutingProbe`` against ``r3bridge.shard`` of the
   canonical batch with the packing the framework really used); decided by
   :func:`assert_r3_passes`;
5. :func:`megatron_r2_check`: R2 recorded by the adapter's compute_log_prob, written back,
   re-partitioned
   differently and replayed, reproduces the recording pass's log-probs with agreement 1.0;
   decided by :func:`assert_r2_passes`.

:func:`run_megatron_checks` runs 4-5 on a list of layouts (:data:`CPU_LAYOUTS`: 1 rank and the
2-rank TP2 + SP, CP2, PP2 x VPP2 layouts; :data:`GPU_LAYOUTS`: 4-rank ones for GPU machines)
for a :class:`~r3bridge.testing.kit.rollouts.ModelShape`, fitted to the model first
(:func:`fit_layouts`: a VPP split the layer count does not allow is replaced by one it does, a
layout the model cannot have is left out, and a :class:`LayoutNote` warning says so before
anything runs). Failures raise ``AssertionError`` naming sample, token and layer (and "shifted
by N rows" when the routes are the expected ones shifted, "its left padding" when the shift is
the sample's padding, "1-based" when the layer ids are the model's plus one).

Layer ids are 0-based global decoder layer indices (HF config index, Megatron ``layer_number - 1``).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from r3bridge.batch.canonical import with_empty_sequences
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.layer_ids import shifted_layer_ids_hint
from r3bridge.errors import DegenerateRouteError, LayoutError
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, rank_positions
from r3bridge.parallel.sharding import shard
from r3bridge.protocols import BatchCodec
from r3bridge.testing.harness.dist import Layout
from r3bridge.testing.kit.rollouts import CanonicalRollout, ModelShape, make_rollout
from r3bridge.testing.kit.runner import MegatronRunner

__all__ = ["CanonicalRollout", "ModelShape", "make_rollout", "MegatronRunner",
           "assert_same_batch", "check_ingest", "random_recorded", "check_recorded_survives_split",
           "default_layouts", "check_same_targets", "fit_layouts", "LayoutNote",
           "megatron_r3_check", "megatron_r2_check", "MegatronCase", "LayoutResult", "megatron_rank",
           "run_megatron_checks", "assert_r3_passes", "assert_read_once_per_micro_batch", "assert_r2_passes",
           "assert_megatron_checks", "layout_name",
           "ONE_RANK", "TWO_RANK", "CPU_LAYOUTS", "GPU_LAYOUTS", "GROUPS", "REGROUPED", "BATCH_SIZE",
           "MIN_COVERAGE", "MAX_LOGPROB_DIFF"]

# ---------------------------------------------------------------------------------- thresholds
MIN_COVERAGE = 0.8          # check 4: share of router rows replayed (the rest: tails no call routed)
MAX_LOGPROB_DIFF = 1e-5     # check 5: replayed vs recorded log-probs, fp32 harness
BATCH_SIZE = 8              # checks 4-5: rollout samples, in GROUPS / REGROUPED
GROUPS = ((0, 3), (1, 2), (4, 5), (6, 7))          # micro-batches of the compute_log_prob pass
REGROUPED = ((5, 1), (0, 4), (2, 7), (3, 6))       # the R2 replay, re-partitioned differently

# ---------------------------------------------------------------------------------- layouts: (world size, layout)
ONE_RANK = ((1, Layout()),)
TWO_RANK = ((2, Layout(tp=2)), (2, Layout(cp=2)), (2, Layout(pp=2, vpp=2)))   # SP split, CP zigzag, VPP
CPU_LAYOUTS = ONE_RANK + TWO_RANK
# for GPU machines (``backend="nccl"``): too slow for 2 CPU cores
GPU_LAYOUTS = ((4, Layout(tp=2, cp=2)), (4, Layout(tp=2, pp=2)), (4, Layout(pp=2, vpp=2, cp=2)),
               (4, Layout(pp=4)))


def layout_name(world_size: int, layout: Layout) -> str:
    """``"2 ranks tp=2"``: the sizes that differ from 1."""
    sizes = [f"{k}={getattr(layout, k)}" for k in ("tp", "cp", "pp", "vpp", "ep", "etp")
             if getattr(layout, k) not in (None, 1)]
    return f"{world_size} rank{'s' if world_size > 1 else ''}" + (" " + " ".join(sizes) if sizes else "")


class LayoutNote(UserWarning):
    """A layout of the checks that the model's shape does not allow: replaced by a legal one, or
    left out (said before anything runs)."""


def _parallel_layout(shape: ModelShape, **sizes: Any) -> ParallelLayout:
    return ParallelLayout(shape.num_layers, shape.moe_layer_freq, **sizes)


def fit_layouts(shape: ModelShape, layouts: Sequence[tuple[int, Layout]]
                ) -> tuple[list[tuple[int, Layout]], list[str]]:
    """The ``(world_size, Layout)`` pairs of checks 4-5 that a model of ``shape`` can be built
    with, decided before any rank starts (megatron would assert only after building the model):
    a VPP split the layer count does not allow is replaced by the smallest one it does (PP2 x VPP2
    of 6 layers runs as PP2 x VPP3), a layout with no legal split is left out. Returns the
    layouts and one note per change (why, and what runs instead)."""
    fitted: list[tuple[int, Layout]] = []
    notes: list[str] = []
    for world_size, lay in layouts:
        name = layout_name(world_size, lay)
        try:
            _parallel_layout(shape, tp=lay.tp, cp=lay.cp, pp=lay.pp, vpp=lay.vpp)
            fitted.append((world_size, lay))
            continue
        except LayoutError as e:
            why = str(e)
        per_stage = shape.num_layers // lay.pp if shape.num_layers % lay.pp == 0 else 0
        legal = [v for v in range(2, per_stage + 1) if per_stage % v == 0] if lay.vpp else []
        if legal:
            instead = dataclasses.replace(lay, vpp=legal[0])
            fitted.append((world_size, instead))
            notes.append(f"{name}: {why} for a model of {shape.num_layers} layers: ran "
                         f"{layout_name(world_size, instead)} instead")
        else:
            notes.append(f"{name}: {why} for a model of {shape.num_layers} layers: left out (no legal split)")
    return fitted, notes


def _say(notes: Sequence[str]) -> None:
    for note in notes:
        warnings.warn(note, LayoutNote, stacklevel=3)


# ---------------------------------------------------------------------------------- check 1
def _shift_of(got: torch.Tensor, got_valid: torch.Tensor, want: torch.Tensor, want_valid: torch.Tensor,
              max_shift: Optional[int] = None, padding: Optional[int] = None) -> Optional[int]:
    """``s`` when ``got`` row ``r`` equals ``want`` row ``r - s`` on every row both route (at
    least two, and half of ``want``'s routed rows), the smallest ``|s|`` first; else None. Every
    shift that leaves two rows overlapping is tried (default ``max_shift``): a padding bug
    shifts each sample by its own padding, which can be most of the sample, so a shift of
    exactly ``padding`` (either way) needs only two matching rows."""
    if max_shift is None:
        max_shift = max(got.shape[0], want.shape[0])
    first = [s for s in (padding, -padding) if padding] if padding else []
    for s in first + sorted(range(-max_shift, max_shift + 1), key=abs):
        lo, hi = max(0, s), min(got.shape[0], want.shape[0] + s)
        if s == 0 or hi - lo < 2:
            continue
        both = got_valid[lo:hi] & want_valid[lo - s:hi - s]
        if int(both.sum()) < (2 if s in first else max(2, int(want_valid.sum()) // 2)):
            continue
        if torch.equal(got[lo:hi][both], want[lo - s:hi - s][both]):
            return s
    return None


def _mostly_padding(got: torch.Tensor, got_valid: torch.Tensor, want: torch.Tensor, want_valid: torch.Tensor,
                    padding: int) -> bool:
    """A sample at most one row longer than its padding, read ``padding`` rows late: no routed row
    before ``padding``, and the rows after it (at most one) are ``want``'s first ones."""
    n = want.shape[0]
    if padding < n - 1 or not bool(want_valid.any()) or bool(got_valid[:padding].any()):
        return False
    tail = got_valid[padding:]
    return bool(torch.equal(got[padding:][tail], want[:tail.shape[0]][tail]))


def _shift_words(s: int, padding: Optional[int] = None) -> str:
    rows = f"{s} row{'' if abs(s) == 1 else 's'}"
    where = "late" if s > 0 else "early"
    out = f"shifted by {rows} (token t holds the route of token t{-s:+d}: routes placed {abs(s)} token(s) {where})"
    if padding is not None and padding and abs(s) == padding:
        out += (f", exactly the sample's padding ({padding} token(s) to the batch's longest sample): a padded "
                f"batch read with the padding on the wrong side (left vs right: mask, positions or "
                f"from_padded's detection)")
    return out


def _sample_difference(i: int, got: ReplayBatch, want: ReplayBatch, padding: Optional[int] = None
                       ) -> Optional[tuple[str, Optional[int]]]:
    """(the first difference of sample ``i``, the shift of its routes or None), or None.
    ``padding``: the sample's padding in a batch padded to its longest sample."""
    ra, va = got.sequence(i)
    rb, vb = want.sequence(i)
    comparable = got.layer_ids == want.layer_ids and got.topk == want.topk
    if ra.shape[0] == rb.shape[0] and torch.equal(va, vb) and (not comparable or torch.equal(ra, rb)):
        return None
    words = []
    s = _shift_of(ra, va, rb, vb, padding=padding) if comparable else None
    if s is not None:
        words.append(f"sample {i}: routes equal the expected ones {_shift_words(s, padding)}")
    elif comparable and padding and _mostly_padding(ra, va, rb, vb, padding):
        # shifted by its padding, a short sample keeps at most one row of its own: too few to match
        s = padding
        words.append(f"sample {i}: no routed row but at most its last, and its padding ({padding} token(s) to the "
                     f"batch's longest sample) is as long as the sample: its rows were read from the padding side")
    if ra.shape[0] != rb.shape[0]:
        words.append(f"sample {i}: {ra.shape[0]} rows, want {rb.shape[0]}")
    n = min(ra.shape[0], rb.shape[0])
    bad_valid = (va[:n] != vb[:n]).nonzero()
    bad_route = (((ra[:n] != rb[:n]).flatten(1).any(1)) & va[:n] & vb[:n]).nonzero() if comparable else bad_valid[:0]
    first = min([int(x[0]) for x in (bad_valid, bad_route) if x.numel()], default=None)
    if first is not None and bad_valid.numel() and int(bad_valid[0]) == first:
        words.append(f"sample {i}, token {first}: valid {bool(va[first])}, want {bool(vb[first])}")
    elif first is not None:
        layer = int((ra[first] != rb[first]).any(-1).nonzero()[0])
        words.append(f"sample {i}, token {first}, layer {got.layer_ids[layer]}: routes {ra[first, layer].tolist()}, "
                     f"want {rb[first, layer].tolist()}")
    return ("; ".join(words) if words else f"sample {i}: routes differ"), s


def assert_same_batch(got: ReplayBatch, want: ReplayBatch, what: str = "", *,
                      padding: Optional[Sequence[int]] = None) -> None:
    """Byte-identical, or ``AssertionError`` naming the first differing sample, token and layer,
    and saying "shifted by N rows" (and how many samples are) when the routes are the expected
    ones shifted; ``padding`` (per sample: its padding in a batch padded to the longest sample)
    lets it name a shift by exactly that much as padding on the wrong side."""
    if got.to_bytes() == want.to_bytes():
        return
    msg = [f"{what}: ReplayBatches differ" if what else "ReplayBatches differ"]
    for name in ("route_kind", "engine", "layer_ids", "num_experts", "topk", "start_rows"):
        a, b = getattr(got, name), getattr(want, name)
        if a != b:
            hint = shifted_layer_ids_hint(a, b) if name == "layer_ids" else ""
            msg.append(f"{name}: got {a!r}, want {b!r}{hint}")
    if got.num_seqs != want.num_seqs:
        msg.append(f"{got.num_seqs} sequences, want {want.num_seqs}")
    else:
        pads = list(padding) if padding is not None and len(padding) == got.num_seqs else [None] * got.num_seqs
        diffs = {i: d for i in range(got.num_seqs) if (d := _sample_difference(i, got, want, pads[i])) is not None}
        if diffs:
            msg.append(next(iter(diffs.values()))[0])
            padded = [i for i, (_, s) in diffs.items() if s and pads[i] and abs(s) == pads[i]]
            shifts = Counter(shift for i, (_, shift) in diffs.items() if shift is not None and i not in padded)
            for shift, count in shifts.items():
                msg.append(f"{count} of {got.num_seqs} samples shifted by {shift} row{'' if abs(shift) == 1 else 's'}")
            if padded:
                msg.append(f"{len(padded)} of {got.num_seqs} samples ({padded}) shifted each by exactly its own padding: "
                           f"a left- / right-padding mix-up, not an off-by-one")
            if len(diffs) > 1:
                msg.append(f"samples differing: {list(diffs)}")
    raise AssertionError("; ".join(msg))


def check_ingest(codec: BatchCodec, native: Any, rollout: CanonicalRollout, what: str = "") -> ReplayBatch:
    """(1) the native batch carries exactly the canonical routes. Returns what the codec read."""
    longest = max((len(t) for t in rollout.tokens), default=0)
    padding = [longest - len(t) for t in rollout.tokens]
    try:
        got = codec.to_replay_batch(native, route_kind="rollout")
    except DegenerateRouteError as e:
        # a misplaced read puts zero or repeated rows inside a sample, which the reader refuses
        # before any comparison: read again with such rows as "no route" to say what went wrong
        handed = getattr(codec, "handed_routes", None)
        if handed is None:
            raise
        lenient = handed(native, route_kind="rollout").to_batch(degenerate="native")
        try:
            assert_same_batch(lenient, rollout.expected(), what or type(codec).__name__, padding=padding)
        except AssertionError as diff:
            raise AssertionError(f"{e}; read with such rows as no route: {diff}") from e
        raise
    assert_same_batch(got, rollout.expected(), what or type(codec).__name__, padding=padding)
    lens = codec.seq_lens(native)
    want = [len(t) for t in rollout.tokens]
    if list(lens) != want:
        raise AssertionError(f"{what or type(codec).__name__}: seq_lens {list(lens)} != trajectory lengths {want}")
    return got


# ---------------------------------------------------------------------------------- check 2
def random_recorded(rollout: CanonicalRollout, seed: int = 3) -> ReplayBatch:
    """Random R2 routes (``route_kind="recorded"``, one row per token, every row valid) for the
    rollout's samples: what a recording pass returns."""
    generator = torch.Generator().manual_seed(seed)
    return ReplayBatch.from_ragged(
        [torch.rand(len(t), len(rollout.moe_layer_ids), rollout.num_experts, generator=generator)
         .topk(rollout.topk, -1).indices for t in rollout.tokens],
        num_experts=rollout.num_experts, layer_ids=rollout.moe_layer_ids, route_kind="recorded")


def check_recorded_survives_split(codec: BatchCodec, native: Any, recorded: ReplayBatch,
                                  parts: Sequence[int] = (1, 2, 3), orders: Sequence[Optional[list[int]]] = (None,)
                                  ) -> int:
    """(2) R2 routes written back survive the framework's re-partitioning. Returns parts checked."""
    native = codec.write_recorded(native, recorded)
    whole = codec.to_replay_batch(native, route_kind="recorded")
    assert_same_batch(whole, recorded, "recorded routes read back from the whole batch")
    n = 0
    for order in orders:
        for p in parts:
            kw = {} if order is None else {"order": order}
            for part, ids in codec.split(native, p, **kw):
                got = codec.to_replay_batch(part, route_kind="recorded")
                assert_same_batch(got, recorded.select(ids), f"part of a {p}-way split holding batch samples {ids} "
                                                             f"(sample k below: the part's k-th)")
                n += 1
    if n == 0:
        raise AssertionError("codec.split returned no part: nothing was checked")
    return n


# ---------------------------------------------------------------------------------- check 3
def default_layouts(shape: Optional[ModelShape] = None) -> list[tuple[ParallelLayout, list[tuple[int, int, int, int]]]]:
    """(layout, rank keys) pairs for check 3, derived from the shape (default:
    :class:`ModelShape`'s): TP+SP, CP zigzag, TP+CP+PP, VPP (the smallest split the layer count
    allows) and PP with an uneven first stage; a layout the model cannot have is left out with a
    :class:`LayoutNote` warning saying why."""
    shape = shape or ModelShape()
    per_stage = shape.num_layers // 2 if shape.num_layers % 2 == 0 else 0
    vpp = next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 2)
    sizes = (dict(tp=2), dict(cp=2), dict(tp=2, cp=2, pp=2), dict(pp=2, vpp=vpp),
             dict(num_layers_in_first_pipeline_stage=1, pp=2))
    out, notes = [], []
    for kw in sizes:
        try:
            lay = _parallel_layout(shape, **kw)
        except LayoutError as e:    # e.g. PP 2 of 5 layers: not a layout of this model
            notes.append(f"check 3 layout {kw}: {e} for a model of {shape.num_layers} layers: left out")
            continue
        keys = [(t, c, p, v) for t in range(lay.tp) for c in range(lay.cp) for p in range(lay.pp)
                for v in range(lay.vp_size)]
        out.append((lay, keys))
    _say(notes)
    return out


def _target_row(layout: ParallelLayout, seq_lens: Sequence[int], tp_rank: int, cp_rank: int, row: int) -> str:
    """``sample s, token t`` of router row ``row`` of rank (tp_rank, cp_rank) (THD packing)."""
    seqs, pos = rank_positions(PackPlan.build(layout, seq_lens), layout, tp_rank, cp_rank)
    return f"sample {int(seqs[row])}, token {int(pos[row])}"


def check_same_targets(batches: dict[str, ReplayBatch], seq_lens: Sequence[int], layouts=None) -> int:
    """(3) identical per-rank targets from every batch. Returns the number of rank targets compared.
    A difference names the layout, rank, sample, token and layer."""
    names = list(batches)
    n = 0
    for lay, keys in (layouts or default_layouts()):
        for (t, c, p, v) in keys:
            ref = None
            where = f"{lay} rank (tp, cp, pp, vp) = {(t, c, p, v)}"
            for name in names:
                tg = shard(batches[name], lay, seq_lens, tp_rank=t, cp_rank=c, pp_rank=p, vp_stage=v)
                if ref is None:
                    ref = (name, tg)
                    continue
                ref_name, ref_tg = ref
                if not torch.equal(tg.valid, ref_tg.valid):
                    row = int((tg.valid != ref_tg.valid).nonzero()[0])
                    raise AssertionError(f"{name} vs {ref_name}: validity differs on {where}, "
                                         f"{_target_row(lay, seq_lens, t, c, row)}: {bool(tg.valid[row])} vs "
                                         f"{bool(ref_tg.valid[row])}")
                if tg.layer_ids != ref_tg.layer_ids:
                    raise AssertionError(f"{name} vs {ref_name}: layers {tg.layer_ids} vs {ref_tg.layer_ids} on {where}")
                for lid in tg.layer_ids:
                    if not torch.equal(tg.indices[lid], ref_tg.indices[lid]):
                        row = int((tg.indices[lid] != ref_tg.indices[lid]).any(-1).nonzero()[0])
                        raise AssertionError(f"{name} vs {ref_name}: targets differ on {where}, "
                                             f"{_target_row(lay, seq_lens, t, c, row)}, layer {lid}: "
                                             f"{tg.indices[lid][row].tolist()} vs {ref_tg.indices[lid][row].tolist()}")
                n += 1
    if n == 0:
        raise AssertionError("no rank target was compared")
    return n


# ---------------------------------------------------------------------------------- check 4
def _router_mismatch(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor, plan: PackPlan,
                     layout: ParallelLayout, ctx: Any, samples: Sequence[Any]) -> str:
    """Which sample and token the first wrong router row is, and how many rows are wrong."""
    bad = ((got != want).any(1) & valid).nonzero().flatten()
    row = int(bad[0])
    seqs, pos = rank_positions(plan, layout, ctx.tp_rank, ctx.cp_rank)
    seq = int(seqs[row])
    sample = samples[seq] if seq < len(samples) else f"padding sequence {seq}"
    return (f"sample {sample}, token {int(pos[row])}: router chose {got[row].tolist()}, want {want[row].tolist()} "
            f"({bad.numel()} of {int(valid.sum())} valid rows differ)")


def megatron_r3_check(ctx: Any, runner: MegatronRunner, rollout: CanonicalRollout, groups, chunks: list) -> dict:
    """(4) every router call of an R3 pass dispatches the canonical routes on valid rows.
    Returns ``{"errors": [...], "checked_rows": n, "metrics": {...}}`` (decide with
    :func:`assert_r3_passes`); each error names layer, micro-batch, sample and token."""
    from r3bridge.testing.harness.probe import RoutingProbe

    obj = runner.attach(ctx, chunks, "R3")
    mbs = runner.micro_batches(rollout, groups, key="rollout")
    with RoutingProbe(chunks, include_mtp=False) as probe:
        res = runner.run(obj, mbs, phase="compute_log_prob")
    expected = rollout.expected()
    layout = obj.replayer.layout if hasattr(obj, "replayer") else ParallelLayout.from_megatron(chunks[0].config)
    errors, checked, token_rows = [], 0, 0
    by_layer: dict[int, list] = {}
    for call in probe.calls:
        by_layer.setdefault(call.layer_id, []).append(call)
    if len(res["packing"]) < len(groups):
        errors.append(f"the runner reported {len(res['packing'])} packing entries for {len(groups)} micro-batches")
        return {"errors": errors, "checked_rows": 0, "metrics": res["metrics"]}
    for lid, calls in by_layer.items():
        if len(calls) != len(groups):
            errors.append(f"layer {lid}: {len(calls)} router calls for {len(groups)} micro-batches")
            continue
        for m, (call, g) in enumerate(zip(calls, groups)):
            pk = dict(res["packing"][m])
            seq_lens = pk.pop("seq_lens")
            g = list(pk.pop("samples", g))    # frameworks that re-balance micro-batches report their own
            routes = expected.select(g)
            if len(seq_lens) > len(g):        # framework padding "sequences" (no routes)
                routes = with_empty_sequences(routes, seq_lens[len(g):])
            tg = shard(routes, layout, seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank, pp_rank=ctx.pp_rank,
                       vp_stage=call.chunk, layer_ids=[lid], **pk)
            got = call.topk()
            want = tg.indices[lid].sort(dim=1).values
            v = tg.valid
            where = f"layer {lid}, micro-batch {m}"
            plan = PackPlan.build(layout, seq_lens, **pk)
            seqs, pos = rank_positions(plan, layout, ctx.tp_rank, ctx.cp_rank)
            # the samples' real tokens (not the framework's padding "sequences": no sample's, never counted)
            token_rows += int(((pos < plan.seq_lens[seqs]) & (seqs < len(g))).sum()) if seqs.numel() else 0
            if got.shape != want.shape:
                errors.append(f"{where}: router saw {tuple(got.shape)} rows, targets {tuple(want.shape)}")
            elif not torch.equal(got[v], want[v]):
                errors.append(f"{where}: {_router_mismatch(got, want, v, plan, layout, ctx, g)}")
            checked += int(v.sum())
    # the coverage the rollout itself allows on this rank: aborted samples and untracked tails
    # have no route, so an adapter cannot replay them (None: this rank holds no MoE layer)
    expected_coverage = checked / token_rows if token_rows else None
    return {"errors": errors, "checked_rows": checked, "metrics": res["metrics"],
            "expected_coverage": expected_coverage, "reads": _read_stats(chunks),
            "micro_batches": len(res["packing"])}


def _read_stats(chunks: list) -> Optional[dict]:
    """How the replaying driver of ``chunks`` read its routes (:class:`r3bridge.parallel.read.ReadStats`),
    found through the hook megatron-core calls on their routers (``None``: no replaying driver)."""
    from r3bridge.testing.harness.probe import find_routers

    for ref in find_routers(chunks):
        rep = getattr(getattr(ref.module, "router_replay", None), "replayer", None)
        if rep is not None and hasattr(rep, "read_stats"):
            return rep.read_stats.as_dict()
    return None


# ---------------------------------------------------------------------------------- check 5
def megatron_r2_check(ctx: Any, runner: MegatronRunner, rollout: CanonicalRollout, record_groups, replay_groups,
                      chunks: list) -> dict:
    """(5) record under R2, write back, replay re-partitioned: same log-probs, agreement 1.0.
    Returns plain data; decide with :func:`assert_r2_passes`."""
    obj = runner.attach(ctx, chunks, "R2")
    rec_res = runner.run(obj, runner.micro_batches(rollout, record_groups, key=None), phase="compute_log_prob")
    recorded = rec_res["recorded"]
    runner.write_recorded(rollout, recorded)
    rep_res = runner.run(obj, runner.micro_batches(rollout, replay_groups, key="recorded"), phase="update")
    order_rec = [i for g in record_groups for i in g]
    order_rep = [i for g in replay_groups for i in g]
    lp_rec = {i: lp for i, lp in zip(order_rec, rec_res["logprobs"])}
    lp_rep = {i: lp for i, lp in zip(order_rep, rep_res["logprobs"])}
    diffs = {i: float((lp_rec[i] - lp_rep[i]).abs().max()) for i in lp_rec if lp_rep.get(i) is not None}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {"recorded_rows": None if recorded is None else recorded.rows_per_seq,
            "max_logprob_diff": diffs[worst] if diffs else None, "worst_sample": worst,
            "agreement": rep_res["metrics"].get("r3bridge/agreement/mean"), "metrics": rep_res["metrics"],
            # what the adapter hands to the framework's own metrics logging, if it says (optional)
            "framework_metrics": rep_res.get("framework_metrics")}


# ---------------------------------------------------------------------------------- checks 4-5 on ranks
@dataclass(frozen=True)
class MegatronCase:
    """Everything a rank needs for checks 4-5 (picklable: it travels to spawned ranks).

    ``make_runner(rollout)`` builds a fresh :class:`MegatronRunner` (a class or a
    ``functools.partial`` of one: lambdas do not pickle); ``extras(ctx, runners)``, optional,
    runs after the checks on each rank with the two runners used (R3, R2) and its picklable
    result is kept under ``"extras"``."""

    make_runner: Callable[[CanonicalRollout], MegatronRunner]
    shape: ModelShape = field(default_factory=ModelShape)
    spec: Any = None                    # a ModelSpec; None: shape.model_spec()
    rollout_seed: int = 11
    extras: Optional[Callable[[Any, list], Any]] = None
    aborted: tuple[int, ...] = ()       # rollout samples whose engine call returned no routes
    single_call: bool = False           # one engine call per sample (make_rollout's single_call)


@dataclass
class LayoutResult:
    """The per-rank results of checks 4-5 on one layout."""

    world_size: int
    layout: Layout
    ranks: list[dict]

    @property
    def name(self) -> str:
        return layout_name(self.world_size, self.layout)


def megatron_rank(ctx: Any, case: MegatronCase) -> dict:
    """Rank function of checks 4-5: a fresh runner and fresh chunks per check."""
    from r3bridge.testing.harness.models import build_model_chunks

    spec = case.spec if case.spec is not None else case.shape.model_spec()
    rollout = case.shape.rollout(case.rollout_seed, batch_size=BATCH_SIZE, aborted=case.aborted,
                                 single_call=case.single_call)
    runners: list = []

    def fresh() -> MegatronRunner:
        runners.append(case.make_runner(rollout))
        return runners[-1]
    out = {"r3": megatron_r3_check(ctx, fresh(), rollout, GROUPS, build_model_chunks(spec, ctx)),
           "r2": megatron_r2_check(ctx, fresh(), rollout, GROUPS, REGROUPED, build_model_chunks(spec, ctx)),
           "rank": ctx.rank, "pp_rank": ctx.pp_rank, "pp": ctx.pp, "last_stage": ctx.is_last_stage}
    if case.extras is not None:
        out["extras"] = case.extras(ctx, runners)
    return out


def run_megatron_checks(case: MegatronCase, layouts: Sequence[tuple[int, Layout]] = CPU_LAYOUTS, *,
                        timeout: float = 900.0, backend: str = "gloo") -> list[LayoutResult]:
    """Checks 4-5 on every ``(world_size, layout)`` the model allows (:func:`fit_layouts`,
    decided and said in a :class:`LayoutNote` warning before any rank starts): one set of
    processes per world size (:func:`r3bridge.testing.harness.dist.spawn_layouts`). Returns the results;
    decide with :func:`assert_megatron_checks`. A failing rank raises ``RankError`` with its
    traceback."""
    from r3bridge.testing.harness.dist import spawn_layouts

    layouts, notes = fit_layouts(case.shape, layouts)
    _say(notes)
    if not layouts:
        raise AssertionError("no layout of checks 4-5 fits the model: " + "; ".join(notes))
    out: list[LayoutResult] = []
    for world_size in dict.fromkeys(w for w, _ in layouts):
        mine = [lay for w, lay in layouts if w == world_size]
        per_layout = spawn_layouts(megatron_rank, world_size=world_size, layouts=mine, args=(case,),
                                   timeout=timeout, backend=backend)
        out += [LayoutResult(world_size, lay, ranks) for lay, ranks in zip(mine, per_layout)]
    return out


def assert_r3_passes(result: LayoutResult, *, min_coverage: float = MIN_COVERAGE) -> int:
    """Check 4 decided on one layout: no router row differs, coverage above ``min_coverage`` of
    what the rollout routes on every rank (rows of aborted samples and untracked tails have no
    route to replay; a rank whose stages hold no MoE layer has none to check), some rows checked.
    Returns the rows checked."""
    checked = 0
    for rank, r in enumerate(result.ranks):
        errors = r["r3"]["errors"]
        if errors:
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            raise AssertionError(f"check 4 on {result.name}, rank {rank}: " + "; ".join(errors[:5]) + more)
        coverage = r["r3"]["metrics"].get("r3bridge/coverage")
        expected = r["r3"].get("expected_coverage", 1.0)
        if expected is None and coverage is None and not r["r3"]["checked_rows"]:
            continue                    # no MoE layer on this rank's stages
        share = None if coverage is None else coverage / expected if expected else coverage
        if share is None or not share > min_coverage:
            raise AssertionError(f"check 4 on {result.name}, rank {rank}: coverage {coverage} is not above "
                                 f"{min_coverage} of the {expected} the rollout routes (rows the adapter left to "
                                 f"native routing)")
        checked += r["r3"]["checked_rows"]
    if checked == 0:
        raise AssertionError(f"check 4 on {result.name}: no router row was checked")
    return checked


def assert_read_once_per_micro_batch(result: LayoutResult, *, form: Optional[str] = None) -> None:
    """Check 4's route path: on every rank the R3 pass's routes reached the routers through the
    one reader (docs/architecture.md, "One reader"), each micro-batch's routes read from one handed object and
    its row map built once, whatever its chunks (VPP); ``form`` (e.g. ``"packed/zero"``): what the
    adapter hands over, its buffer's storage form and "no route" kind (``ReadStats.forms`` keys
    start with it)."""
    for rank, r in enumerate(result.ranks):
        reads, n = r["r3"].get("reads"), r["r3"].get("micro_batches")
        where = f"check 4 on {result.name}, rank {rank}"
        if reads is None:
            raise AssertionError(f"{where}: no replaying r3bridge driver on the routers")
        if reads["routes"] != n or reads["row_maps"] != n or reads["reads"] < n:
            raise AssertionError(f"{where}: {n} micro-batches, but the driver read {reads['routes']} handed routes, "
                                 f"built {reads['row_maps']} row maps and made {reads['reads']} reads: {reads}")
        if form is not None and any(not k.startswith(form) for k in reads["forms"]):
            raise AssertionError(f"{where}: routes handed as {sorted(reads['forms'])}, expected {form}/...")


def assert_r2_passes(result: LayoutResult, *, batch_size: int = BATCH_SIZE,
                     max_logprob_diff: float = MAX_LOGPROB_DIFF) -> float:
    """Check 5 decided on one layout: every rank recorded one sequence per sample and replayed
    with agreement 1.0; every last-stage rank compared log-probs, all within
    ``max_logprob_diff``. Returns the largest difference."""
    diffs = []
    for rank, r in enumerate(result.ranks):
        r2 = r["r2"]
        where = f"check 5 on {result.name}, rank {rank}"
        rows = r2["recorded_rows"]
        if rows is None or len(rows) != batch_size:
            raise AssertionError(f"{where}: R2 recorded {None if rows is None else len(rows)} sequences for "
                                 f"{batch_size} samples")
        agreement = r2["agreement"]
        if agreement is None or abs(agreement - 1.0) > 1e-6:
            raise AssertionError(f"{where}: agreement {agreement} replaying the recorded routes, want 1.0")
        if r2["max_logprob_diff"] is None:
            if r["last_stage"]:
                raise AssertionError(f"{where}: a last-stage rank whose runner returned no log-probs to compare")
            continue
        if not r2["max_logprob_diff"] < max_logprob_diff:
            raise AssertionError(f"{where}: sample {r2['worst_sample']}'s replayed log-probs differ from the "
                                 f"recording pass by {r2['max_logprob_diff']:.3g} (limit {max_logprob_diff})")
        diffs.append(r2["max_logprob_diff"])
    if not diffs:
        raise AssertionError(f"check 5 on {result.name}: no rank compared log-probs")
    return max(diffs)


def assert_megatron_checks(results: Sequence[LayoutResult], *, min_coverage: float = MIN_COVERAGE,
                           max_logprob_diff: float = MAX_LOGPROB_DIFF) -> None:
    """Checks 4 and 5 decided on every layout (the plain-function form of
    :class:`r3bridge.testing.kit.suite.BaseMegatronTests`)."""
    if not results:
        raise AssertionError("no layout was run")
    for result in results:
        assert_r3_passes(result, min_coverage=min_coverage)
        assert_r2_passes(result, max_logprob_diff=max_logprob_diff)
