"""What every router call dispatched, per token, in one format for every framework (tests only).

The real-framework runners (``verl_job``, ``skyrl_real``, ``areal_runner``) each see router calls
in their own packing: verl's dynamic-bsz THD micro-batches, SkyRL's left-padding-removed BSHD
micro-batches, AReaL's token-balanced THD micro-batches with a padding "sequence". To compare
frameworks, each runner maps every router row back to the (sample, token position) it routed,
with the packing the framework really used and r3bridge's own row map
(:func:`r3bridge.parallel.packing.rank_positions`), and logs

    (step, phase, grad_enabled, sample, token, layer) -> sorted top-k expert ids

for every real (non-padding) row (:class:`DispatchLog`, one per rank; merged with
:meth:`DispatchRecords.merge`). :func:`compare_dispatch` then checks that the frameworks'
records cover the same keys (every token of every sample reached every MoE router in each pass)
and that on every row the rollout routed, every framework dispatched exactly the rollout's ids
(byte-identical sorted id tensors), naming the first differing (sample, token, layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, rank_positions

__all__ = ["PHASES", "DispatchRecords", "DispatchLog", "router_rows", "compare_dispatch", "Agreement", "describe",
           "with_route_changed"]

PHASES = ("compute_log_prob", "update")
_KEY_COLS = ("step", "phase", "grad", "sample", "token", "layer")


def router_rows(samples: Sequence[int], seq_lens: Sequence[int], layout: ParallelLayout, *, tp_rank: int,
                cp_rank: int = 0, format: str = "thd", cu_seqlens_padded: Optional[Sequence[int]] = None,
                seq_length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, token position) of every router row of this rank for one micro-batch, -1 on padding.

    ``seq_lens``: real tokens of each packed sequence (framework padding "sequences" included, at
    the end); ``samples[i]``: the rollout sample of sequence ``i`` (fewer than ``seq_lens``: the
    rest are padding). The packing arguments are those of :meth:`r3bridge.parallel.packing.PackPlan.build`.
    """
    plan = PackPlan.build(layout, seq_lens, format=format, cu_seqlens_padded=cu_seqlens_padded,
                          seq_length=seq_length)
    seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
    sample_of = torch.full((plan.num_seqs,), -1, dtype=torch.int64)
    sample_of[:len(samples)] = torch.tensor(list(samples), dtype=torch.int64)
    real = (pos < plan.seq_lens[seq]) & (sample_of[seq] >= 0)
    return torch.where(real, sample_of[seq], -1), torch.where(real, pos, -1)


@dataclass
class DispatchRecords:
    """One framework's dispatch log: ``keys[n] = (step, phase index, grad, sample, token, layer)``
    (int64), ``ids[n]`` the sorted top-k expert ids (int64). Picklable."""

    framework: str
    keys: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 6), dtype=torch.int64))
    ids: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 0), dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @classmethod
    def merge(cls, parts: Sequence["DispatchRecords"]) -> "DispatchRecords":
        """The ranks' logs of one framework as one. A key on several ranks must carry the same ids
        there (SP off: every TP rank routes every row); a conflict raises ``AssertionError``."""
        if not parts:
            raise AssertionError("no records to merge")
        name = parts[0].framework
        table: dict[tuple, tuple] = {}
        for p in parts:
            if p.framework != name:
                raise AssertionError(f"merging records of {name!r} and {p.framework!r}")
            for k, v in zip(p.keys.tolist(), p.ids.tolist()):
                k, v = tuple(k), tuple(v)
                if table.setdefault(k, v) != v:
                    raise AssertionError(f"{name}: {describe(k)} dispatched {list(table[k])} on one rank, "
                                         f"{list(v)} on another")
        if not table:
            return cls(name)
        keys = sorted(table)
        return cls(name, torch.tensor(keys, dtype=torch.int64), torch.tensor([table[k] for k in keys], dtype=torch.int64))

    def table(self) -> dict[tuple, torch.Tensor]:
        """key tuple -> sorted id tensor."""
        return {tuple(k): v for k, v in zip(self.keys.tolist(), self.ids.unbind(0))}

    def where(self, **eq: int) -> "DispatchRecords":
        """The records whose key columns equal ``eq`` (e.g. ``step=0``; ``phase`` by name)."""
        keep = torch.ones(len(self), dtype=torch.bool)
        for name, v in eq.items():
            v = PHASES.index(v) if name == "phase" and isinstance(v, str) else int(v)
            keep &= self.keys[:, _KEY_COLS.index(name)] == v
        return DispatchRecords(self.framework, self.keys[keep], self.ids[keep])

    def relabel(self, framework: Optional[str] = None, **col: int) -> "DispatchRecords":
        """A copy with key columns set (e.g. ``step=0`` to compare another step's records)."""
        keys = self.keys.clone()
        for name, v in col.items():
            keys[:, _KEY_COLS.index(name)] = PHASES.index(v) if name == "phase" and isinstance(v, str) else int(v)
        return DispatchRecords(framework or self.framework, keys, self.ids.clone())


def describe(key: Sequence[int]) -> str:
    step, phase, grad, sample, token, layer = key
    return f"step {step} {PHASES[phase]} grad={bool(grad)} sample {sample} token {token} layer {layer}"


class DispatchLog:
    """One rank's log: :meth:`add` one router call at a time."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self._keys: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []

    def add(self, *, step: int, phase: str, grad: bool, layer: int, topk: torch.Tensor, sample: torch.Tensor,
            token: torch.Tensor) -> int:
        """One router call: ``topk`` ``[rows, K]`` dispatched ids, ``sample`` / ``token`` per row
        (:func:`router_rows`, -1 on padding rows, which are skipped). Returns the rows logged."""
        if topk.shape[0] != sample.numel():
            raise AssertionError(f"{self.framework} {phase} layer {layer}: router saw {topk.shape[0]} rows, "
                                 f"the packing gives {sample.numel()}")
        real = sample >= 0
        n = int(real.sum())
        head = torch.tensor([step, PHASES.index(phase), int(grad)], dtype=torch.int64).expand(n, 3)
        self._keys.append(torch.cat([head, sample[real].unsqueeze(1), token[real].unsqueeze(1),
                                     torch.full((n, 1), int(layer), dtype=torch.int64)], 1))
        self._ids.append(topk[real].to(torch.int64).sort(dim=1).values)
        return n

    def records(self) -> DispatchRecords:
        """This rank's records; a key logged twice (a token routed twice by one layer in one pass)
        raises ``AssertionError``."""
        if not self._keys:
            return DispatchRecords(self.framework)
        keys, ids = torch.cat(self._keys), torch.cat(self._ids)
        uniq, counts = torch.unique(keys, dim=0, return_counts=True)
        if bool((counts > 1).any()):
            k = uniq[counts > 1][0].tolist()
            raise AssertionError(f"{self.framework}: {describe(k)} was routed {int(counts.max())} times in one pass")
        return DispatchRecords(self.framework, keys, ids)


@dataclass
class Agreement:
    """:func:`compare_dispatch`'s result: ``errors`` (empty when the frameworks agree), per
    framework the number of keys logged, and the (key, valid row) pairs compared."""

    errors: list[str]
    keys: dict[str, int]
    compared: int


def compare_dispatch(records: Mapping[str, DispatchRecords], expected: ReplayBatch, seq_lens: Sequence[int],
                     *, max_errors: int = 10) -> Agreement:
    """Compare frameworks' records of the same rollout (``expected``: its canonical ReplayBatch,
    ``seq_lens``: its trajectory lengths).

    * every framework logged the same (step, phase, grad) passes, and in each every token of every
      sample on every MoE layer of ``expected`` (no more, no less);
    * on every row ``expected`` holds a route, all frameworks dispatched identical sorted ids, and
      those are the rollout's.
    """
    errors: list[str] = []
    names = list(records)
    tables = {n: records[n].table() for n in names}
    passes = {n: sorted({k[:3] for k in t}) for n, t in tables.items()}
    ref = names[0]
    for n in names[1:]:
        if passes[n] != passes[ref]:
            errors.append(f"passes (step, phase, grad) differ: {ref} {_fmt_passes(passes[ref])}, "
                          f"{n} {_fmt_passes(passes[n])}")
    # every (sample, token, layer) of the rollout, and the rollout's sorted ids where it routed
    want_keys: set[tuple[int, int, int]] = set()
    want_ids: dict[tuple[int, int, int], torch.Tensor] = {}
    for s, n_tok in enumerate(seq_lens):
        routes, valid = expected.sequence(s)
        start = expected.start_rows[s]
        for t in range(n_tok):
            r = t - start
            for li, lid in enumerate(expected.layer_ids):
                want_keys.add((s, t, lid))
                if 0 <= r < valid.numel() and bool(valid[r]):
                    want_ids[(s, t, lid)] = routes[r, li].to(torch.int64).sort().values
    compared = 0
    for p in sorted(set().union(*passes.values())):
        per = {n: {k[3:]: v for k, v in t.items() if k[:3] == p} for n, t in tables.items()}
        for n in names:
            got = set(per[n])
            for what, diff in (("missing", sorted(want_keys - got)), ("unexpected", sorted(got - want_keys))):
                if diff:
                    errors.append(f"{n} {_fmt_pass(p)}: {len(diff)} (sample, token, layer) {what}, first "
                                  f"{diff[:3]}")
        for key in sorted(want_ids):
            have = {n: per[n][key] for n in names if key in per[n]}
            if not have:
                continue
            compared += 1
            want = want_ids[key]
            if any(not torch.equal(v, want) for v in have.values()):
                ids = ", ".join(f"{n} {v.tolist()}" for n, v in have.items())
                errors.append(f"{_fmt_pass(p)} sample {key[0]} token {key[1]} layer {key[2]}: {ids}, "
                              f"rollout {want.tolist()}")
    if len(errors) > max_errors:
        errors = errors[:max_errors] + [f"... {len(errors) - max_errors} more"]
    return Agreement(errors, {n: len(t) for n, t in tables.items()}, compared)


def _fmt_pass(p: tuple) -> str:
    return f"step {p[0]} {PHASES[p[1]]} grad={bool(p[2])}"


def _fmt_passes(ps: list) -> str:
    return "[" + "; ".join(_fmt_pass(p) for p in ps) + "]"


def with_route_changed(rollout, sample: int, token: int, layer: int):
    """A copy of a :class:`~r3bridge.testing.kit.conformance.CanonicalRollout` whose route of
    (``sample``, ``token``, ``layer``) is another top-k set (changed in the first engine call that
    routed the token, the one first-seen stitching keeps)."""
    import copy

    out = copy.deepcopy(rollout)
    call = next((c for c in out.calls[sample] if token < c.shape[0]), None)
    if call is None or layer not in out.moe_layer_ids:
        raise ValueError(f"sample {sample} token {token} layer {layer}: the rollout has no route there")
    old = set(int(x) for x in call[token, layer])
    new = [e for e in range(out.num_experts) if e not in old][:out.topk]
    call[token, layer] = np.asarray(new, dtype=call.dtype)
    return out
