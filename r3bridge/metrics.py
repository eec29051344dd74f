"""Metrics that show replay working: train-vs-rollout log-prob mismatch and route agreement.

Core module: torch only. Every formula is written out in ``docs/metrics.md``.

* :func:`logprob_mismatch` / :func:`logprob_mismatch_packed`: with ``d = train_logp - rollout_logp``
  over valid response tokens (each sequence's last valid token excluded by default, by masking per
  row, never by ``torch.roll``): mean ``|d|``, mean ``d^2``, the k3 KL estimate and ``F(tau)``.
  :func:`logprob_mismatch_sums` returns the raw sums as one tensor so data-parallel ranks can
  all-reduce them before dividing (token-weighted, exact).
* :func:`route_agreement`: offline comparison of two :class:`~r3bridge.ReplayBatch` es (e.g.
  rollout routes vs routes the trainer recorded), rows matched by token position.
* :class:`AgreementCounter`: the online version the Megatron driver feeds from inside the router
  hook; counts stay on device, one ``[num_layers, 4]`` int64 tensor that can be all-reduced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from r3bridge.errors import CoverageError, LayerMappingError, ReplayError, RouteShapeError
from r3bridge.schema import ReplayBatch, ragged_arange

__all__ = [
    "MetricsInputError", "logprob_mismatch", "logprob_mismatch_packed", "logprob_mismatch_sums",
    "mismatch_from_sums", "topk_sets_equal", "route_agreement", "AgreementReport",
    "AgreementCounter", "expert_load", "tag_phase",
]

DEFAULT_TAUS: tuple[float, ...] = (2.0, 5.0)


class MetricsInputError(ReplayError, ValueError):
    """Log-probs, masks or ``cu_seqlens`` handed to a metric have inconsistent shapes or values."""


def _nan_div(num: float, den: float) -> float:
    return num / den if den else float("nan")


def _tau_key(tau: float) -> str:
    return f"F{int(tau)}" if float(tau).is_integer() else f"F{tau:g}"


# ===================================================================================== log-probs
def _mismatch_fields(taus: Sequence[float]) -> tuple[str, ...]:
    return ("abs_diff", "sq_diff", "k3_kl", *(_tau_key(t) for t in taus), "num_tokens")


def _sums_of(d: torch.Tensor, taus: Sequence[float]) -> torch.Tensor:
    """float64 ``[3 + len(taus) + 1]``: sum |d|, sum d^2, sum k3, count(|d| > ln tau)..., n."""
    d = d.to(torch.float64)
    ad = d.abs()
    # expm1(d) - d == exp(d) - 1 - d without the cancellation of exp(d) - 1 near d = 0
    k3 = torch.expm1(d) - d
    parts = [ad.sum(), (d * d).sum(), k3.sum()]
    parts += [(ad > math.log(float(t))).sum().to(torch.float64) for t in taus]
    parts.append(torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device))
    return torch.stack(parts)


def _check_taus(taus: Sequence[float]) -> tuple[float, ...]:
    taus = tuple(float(t) for t in taus)
    if any(not t > 1.0 for t in taus):
        raise MetricsInputError(f"every tau must be > 1 (F(tau) counts |d| > ln tau), got {list(taus)}")
    return taus


def _packed_keep(mask: torch.Tensor, cu_seqlens: torch.Tensor, exclude_last: bool) -> torch.Tensor:
    """Tokens that count: inside a sequence, mask True, and (``exclude_last``) not the last True
    token of their sequence. Vectorised; a sequence never borrows from its neighbour."""
    total = mask.shape[0]
    pos = torch.arange(total, device=mask.device)
    cu = cu_seqlens.to(device=mask.device, dtype=torch.int64)
    n = cu.numel() - 1
    # seg[p] = i for cu[i] <= p < cu[i+1]; p >= cu[-1] (trailing padding) gets n, p < cu[0] gets -1
    seg = torch.bucketize(pos, cu, right=True) - 1
    inside = (seg >= 0) & (seg < n)
    keep = mask & inside
    if exclude_last and n > 0:
        segc = seg.clamp(0, n)   # n: a bucket for positions outside every sequence
        cand = torch.where(keep, pos, torch.full_like(pos, -1))
        last = torch.full((n + 1,), -1, dtype=torch.int64, device=mask.device)
        last = last.scatter_reduce(0, segc, cand, reduce="amax", include_self=True)
        keep = keep & (pos != last[segc])
    return keep


def _as_1d_float(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 2 and t.shape[0] == 1:       # Megatron THD tensors are often [1, T]
        t = t[0]
    if t.dim() != 1:
        raise MetricsInputError(f"{name}: packed log-probs must be 1-D [total_tokens], got shape {tuple(t.shape)}")
    return t


def logprob_mismatch_sums(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    exclude_last: bool = True,
    taus: Sequence[float] = DEFAULT_TAUS,
) -> torch.Tensor:
    """Raw sums behind :func:`logprob_mismatch`, as one float64 tensor on the inputs' device:
    ``[sum |d|, sum d^2, sum k3, count(|d| > ln tau) for each tau, num_tokens]``.

    Sum it across data-parallel ranks (``all_reduce``) and pass it to :func:`mismatch_from_sums`:
    the result is the exact token-weighted metric of the global batch. No host sync here.

    ``[B, T]`` padded inputs when ``cu_seqlens`` is None (``mask`` required, same shape), else
    packed 1-D ``[total]`` inputs with ``cu_seqlens`` ``[n + 1]`` (``mask`` optional, default all
    tokens inside a sequence; tokens at or after ``cu_seqlens[-1]`` never count).
    """
    taus = _check_taus(taus)
    if cu_seqlens is None:
        tr, ro = torch.as_tensor(train_logp), torch.as_tensor(rollout_logp)
        if mask is None:
            raise MetricsInputError("padded [B, T] log-probs need a mask (True on valid response tokens)")
        m = torch.as_tensor(mask, device=tr.device)
        if tr.dim() != 2:
            raise MetricsInputError(f"padded log-probs must be [B, T], got shape {tuple(tr.shape)}")
        if ro.shape != tr.shape or m.shape != tr.shape:
            raise MetricsInputError(
                f"train_logp {tuple(tr.shape)}, rollout_logp {tuple(ro.shape)} and mask "
                f"{tuple(m.shape)} must have the same [B, T] shape")
        b, t = tr.shape
        # each row is one sequence: cu_seqlens = 0, T, 2T, ...
        cu = torch.arange(b + 1, dtype=torch.int64, device=tr.device) * t
        tr, ro, m = tr.reshape(-1), ro.reshape(-1), m.reshape(-1)
    else:
        tr, ro = _as_1d_float(train_logp, "train_logp"), _as_1d_float(rollout_logp, "rollout_logp")
        if ro.shape != tr.shape:
            raise MetricsInputError(f"train_logp {tuple(tr.shape)} and rollout_logp {tuple(ro.shape)} differ")
        cu = torch.as_tensor(cu_seqlens, device=tr.device).to(torch.int64).reshape(-1)
        if cu.numel() < 1:
            raise MetricsInputError("cu_seqlens must have at least one entry")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise MetricsInputError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
        if int(cu[0]) < 0 or int(cu[-1]) > tr.shape[0]:
            raise MetricsInputError(f"cu_seqlens {cu.tolist()} out of range for {tr.shape[0]} tokens")
        if mask is None:
            m = torch.ones(tr.shape[0], dtype=torch.bool, device=tr.device)
        else:
            m = _as_1d_float(torch.as_tensor(mask, device=tr.device), "mask")
            if m.shape != tr.shape:
                raise MetricsInputError(f"mask {tuple(m.shape)} and log-probs {tuple(tr.shape)} differ")
    m = m.bool() if m.dtype == torch.bool else (m != 0)
    keep = _packed_keep(m, cu, exclude_last)
    d = tr.to(torch.float64)[keep] - ro.to(device=tr.device, dtype=torch.float64)[keep]
    return _sums_of(d, taus)


def mismatch_from_sums(sums: torch.Tensor, *, taus: Sequence[float] = DEFAULT_TAUS,
                       prefix: str = "r3bridge/") -> dict[str, float]:
    """Turn :func:`logprob_mismatch_sums` (possibly all-reduced) into the metrics dict.
    One host sync. With zero tokens every mean is 0.0 and ``num_tokens`` is 0."""
    taus = _check_taus(taus)
    names = _mismatch_fields(taus)
    vals = torch.as_tensor(sums).detach().to(torch.float64).cpu().tolist()
    if len(vals) != len(names):
        raise MetricsInputError(f"sums has {len(vals)} entries, expected {len(names)} for taus {list(taus)}")
    n = vals[-1]
    out = {f"{prefix}mismatch/{k}": (v / n if n else 0.0) for k, v in zip(names[:-1], vals[:-1])}
    out[f"{prefix}mismatch/num_tokens"] = float(n)
    return out


def logprob_mismatch(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    exclude_last: bool = True,
    taus: Sequence[float] = DEFAULT_TAUS,
    prefix: str = "r3bridge/",
) -> dict[str, float]:
    """Train-vs-rollout log-prob mismatch over valid response tokens of padded ``[B, T]`` tensors.

    ``d = train_logp - rollout_logp`` (log pi_train(y_t) - log pi_rollout(y_t) of the sampled
    token) on tokens where ``mask`` is True; with ``exclude_last`` the last True token of every row
    is dropped (found per row, so a row never wraps into the next). Keys, with ``prefix``:

    * ``mismatch/abs_diff``  mean |d|
    * ``mismatch/sq_diff``   mean d^2
    * ``mismatch/k3_kl``     mean(exp(d) - 1 - d): with r = pi_train / pi_rollout = exp(d) and
      tokens sampled from pi_rollout, this is Schulman's k3 estimator r - 1 - log r of
      KL(pi_rollout || pi_train) (per token, >= 0 term by term)
    * ``mismatch/F2``, ``mismatch/F5``  fraction of tokens with |d| > ln tau (ratio outside
      [1/tau, tau]), one key per entry of ``taus``
    * ``mismatch/num_tokens``  tokens counted

    Computed in float64 (``expm1`` for k3). Zero counted tokens: means are 0.0.
    """
    sums = logprob_mismatch_sums(train_logp, rollout_logp, mask, exclude_last=exclude_last, taus=taus)
    return mismatch_from_sums(sums, taus=taus, prefix=prefix)


def logprob_mismatch_packed(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    mask: torch.Tensor | None = None,
    *,
    exclude_last: bool = True,
    taus: Sequence[float] = DEFAULT_TAUS,
    prefix: str = "r3bridge/",
) -> dict[str, float]:
    """:func:`logprob_mismatch` for packed (THD) 1-D ``[total]`` tensors: sequence ``i`` is
    ``[cu_seqlens[i], cu_seqlens[i+1])``; ``mask`` (optional) marks response tokens. The last
    True token of every sequence is excluded when ``exclude_last``."""
    sums = logprob_mismatch_sums(train_logp, rollout_logp, mask, cu_seqlens=cu_seqlens,
                                 exclude_last=exclude_last, taus=taus)
    return mismatch_from_sums(sums, taus=taus, prefix=prefix)


# ===================================================================================== routes
def topk_sets_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool ``[...]``: whether ``a[..., :]`` and ``b[..., :]`` hold the same top-k *set*
    (order-insensitive: both sorted along the last axis). Rows are assumed duplicate-free (a
    ReplayBatch validates that; a router's top-k is by construction)."""
    if a.shape != b.shape:
        raise RouteShapeError(f"cannot compare top-k of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        common = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.int32)
        a, b = a.to(common), b.to(common)
    if a.shape[-1] > 1:
        a, b = a.sort(dim=-1).values, b.sort(dim=-1).values
    return (a == b).all(dim=-1)


@dataclass(frozen=True)
class AgreementReport:
    """Result of :func:`route_agreement`. Counts are exact integers; fractions are properties."""

    layer_ids: tuple[int, ...]          # layers compared (in the reference's order)
    agree: tuple[int, ...]              # per layer: compared rows whose top-k sets are equal
    rows_compared: int                  # rows in the overlap that are valid in both batches
    rows_differing_any_layer: int       # compared rows that differ in at least one layer
    rows_overlap: int = 0               # token positions covered by both batches
    rows_valid_only_reference: int = 0  # in the overlap, valid in reference only
    rows_valid_only_other: int = 0      # in the overlap, valid in other only
    layers_only_reference: tuple[int, ...] = ()
    layers_only_other: tuple[int, ...] = ()

    @property
    def per_layer(self) -> dict[int, float]:
        """layer id -> agreement fraction (NaN when no row was compared)."""
        return {lid: _nan_div(a, self.rows_compared) for lid, a in zip(self.layer_ids, self.agree)}

    @property
    def mean(self) -> float:
        """Fraction of compared (row, layer) pairs whose top-k sets are equal (NaN if none)."""
        return _nan_div(sum(self.agree), self.rows_compared * len(self.layer_ids))

    @property
    def tokens_differing_any_layer(self) -> float:
        """Fraction of compared rows whose top-k set differs in at least one layer (NaN if none)."""
        return _nan_div(self.rows_differing_any_layer, self.rows_compared)

    def as_metrics(self, prefix: str = "r3bridge/") -> dict[str, float]:
        """``{prefix}agreement/mean``, ``.../layer_<id>`` (only when rows were compared),
        ``.../tokens_differing_any_layer``, ``.../rows_compared``."""
        out = {f"{prefix}agreement/mean": self.mean}
        if self.rows_compared:
            out.update({f"{prefix}agreement/layer_{lid}": v for lid, v in self.per_layer.items()})
        out[f"{prefix}agreement/tokens_differing_any_layer"] = self.tokens_differing_any_layer
        out[f"{prefix}agreement/rows_compared"] = float(self.rows_compared)
        return out


def route_agreement(reference: ReplayBatch, other: ReplayBatch) -> AgreementReport:
    """Per-layer top-k set agreement of two route sets over the same sequences.

    Sequence ``i`` of both batches is the same sample; rows are matched by token position
    (``start_rows[i] + j``), so batches with different coverage (e.g. rollout routes starting at
    the prompt offset vs routes recorded from token 0) are compared on their overlap. A row counts
    when it is valid in both. Layers are the intersection of both batches' ``layer_ids``.
    Raises when the sequence counts, ``num_experts`` or ``topk`` differ, or no layer is shared.
    """
    if reference.num_seqs != other.num_seqs:
        raise CoverageError(f"route_agreement: reference has {reference.num_seqs} sequences, "
                            f"other has {other.num_seqs}: they must cover the same sequences")
    if reference.num_experts != other.num_experts:
        raise RouteShapeError(f"route_agreement: num_experts differ ({reference.num_experts} vs {other.num_experts})")
    if reference.topk != other.topk:
        raise RouteShapeError(f"route_agreement: topk differs ({reference.topk} vs {other.topk})")
    other_ids = set(other.layer_ids)
    ref_ids = set(reference.layer_ids)
    layers = [lid for lid in reference.layer_ids if lid in other_ids]
    if not layers:
        raise LayerMappingError(f"route_agreement: no common layer (reference {list(reference.layer_ids)}, "
                                f"other {list(other.layer_ids)})")
    a = reference if list(reference.layer_ids) == layers else reference.with_layers(layers)
    b = other if list(other.layer_ids) == layers else other.with_layers(layers)

    sa = torch.tensor(a.start_rows, dtype=torch.int64)
    sb = torch.tensor(b.start_rows, dtype=torch.int64)
    ea = sa + torch.tensor(a.rows_per_seq, dtype=torch.int64)
    eb = sb + torch.tensor(b.rows_per_seq, dtype=torch.int64)
    lo, hi = torch.maximum(sa, sb), torch.minimum(ea, eb)
    n = (hi - lo).clamp(min=0)
    ia = ragged_arange(a.offsets[:-1].cpu() + (lo - sa), n)
    ib = ragged_arange(b.offsets[:-1].cpu() + (lo - sb), n)

    dev = a.routes.device
    ia, ib = ia.to(dev), ib.to(dev)
    va, vb = a.valid[ia], b.valid.to(dev)[ib]
    both = va & vb
    ra = a.routes[ia][both]
    rb = b.routes.to(dev)[ib][both]
    eq = topk_sets_equal(ra, rb)                                   # [rows, L]
    agree = eq.sum(0).tolist() if eq.numel() else [0] * len(layers)
    return AgreementReport(
        layer_ids=tuple(layers),
        agree=tuple(int(x) for x in agree),
        rows_compared=int(both.sum()),
        rows_differing_any_layer=int((~eq).any(1).sum()) if eq.numel() else 0,
        rows_overlap=int(n.sum()),
        rows_valid_only_reference=int((va & ~vb).sum()),
        rows_valid_only_other=int((vb & ~va).sum()),
        layers_only_reference=tuple(x for x in reference.layer_ids if x not in other_ids),
        layers_only_other=tuple(x for x in other.layer_ids if x not in ref_ids),
    )


class AgreementCounter:
    """Per-layer route counters, accumulated on device without host syncs.

    One int64 tensor ``counts [num_layers, 4]``, columns :attr:`FIELDS`:

    * ``agree``     rows whose native top-k set equals the reference (replayed) one
    * ``compared``  rows compared (valid rows, when agreement is computed)
    * ``replayed``  rows routed with the replayed top-k
    * ``native``    rows routed with the router's own top-k (no valid route, or replay off)

    Every rank must build its counter with the same ``layer_ids`` (e.g. all MoE layers of the
    model, not just the local pipeline stage's) so that ``counts`` has the same shape everywhere
    and one ``all_reduce(SUM)`` over the data/model-parallel groups gives the global counts.
    """

    FIELDS = ("agree", "compared", "replayed", "native")

    def __init__(self, layer_ids: int | Sequence[int], *, device: torch.device | str | None = None,
                 counts: torch.Tensor | None = None) -> None:
        ids = tuple(range(layer_ids)) if isinstance(layer_ids, int) else tuple(int(x) for x in layer_ids)
        if len(set(ids)) != len(ids):
            raise LayerMappingError(f"AgreementCounter: duplicate layer ids in {list(ids)}")
        self.layer_ids = ids
        self._slot = {lid: i for i, lid in enumerate(ids)}
        if counts is None:
            counts = torch.zeros((len(ids), len(self.FIELDS)), dtype=torch.int64, device=device)
        elif tuple(counts.shape) != (len(ids), len(self.FIELDS)):
            raise RouteShapeError(f"AgreementCounter: counts must be [{len(ids)}, {len(self.FIELDS)}], "
                                  f"got {tuple(counts.shape)}")
        self.counts = counts

    # ----------------------------------------------------------------------------- feeding
    def slot(self, layer_id: int) -> int:
        try:
            return self._slot[int(layer_id)]
        except KeyError:
            raise LayerMappingError(f"AgreementCounter: layer {layer_id} is not one of {list(self.layer_ids)}") from None

    def add(self, layer_id: int, *, agree=0, compared=0, replayed=0, native=0) -> None:
        """Add counts for one router call. Each value is a Python int or a 0-dim integer tensor
        on the counter's device (e.g. ``mask.sum()``): nothing is moved to the host."""
        row = self.counts[self.slot(layer_id)]
        for col, v in enumerate((agree, compared, replayed, native)):
            if isinstance(v, torch.Tensor):
                row[col] += v.to(torch.int64)
            elif v:
                row[col] += int(v)

    def observe(self, layer_id: int, native_topk: torch.Tensor, reference_topk: torch.Tensor,
                valid: torch.Tensor | None = None, *, replayed: bool = True) -> None:
        """Count one router call from its tensors: ``native_topk`` / ``reference_topk``
        ``[rows, K]``, ``valid [rows]`` (None: all rows have a reference route).

        ``replayed=True`` (R2/R3): valid rows are replayed, invalid rows routed natively;
        ``replayed=False`` (replay off, agreement only): every row is routed natively.
        Agreement is counted over valid rows only.
        """
        rows = int(native_topk.shape[0])
        eq = topk_sets_equal(native_topk, reference_topk.to(native_topk.device))
        if valid is None:
            nvalid = rows
            agree = eq.sum()
        else:
            v = valid.to(device=eq.device, dtype=torch.bool)
            nvalid = v.sum()
            agree = (eq & v).sum()
        if replayed:
            self.add(layer_id, agree=agree, compared=nvalid, replayed=nvalid, native=rows - nvalid)
        else:
            self.add(layer_id, agree=agree, compared=nvalid, native=rows)

    # ----------------------------------------------------------------------------- combining
    def merge(self, other: "AgreementCounter") -> "AgreementCounter":
        """Add ``other``'s counts into this one (same ``layer_ids``). Returns self."""
        if other.layer_ids != self.layer_ids:
            raise LayerMappingError(f"AgreementCounter.merge: layer ids differ ({list(self.layer_ids)} "
                                    f"vs {list(other.layer_ids)})")
        self.counts += other.counts.to(self.counts.device)
        return self

    __iadd__ = merge

    def to_tensor(self) -> torch.Tensor:
        """A copy of ``counts`` (int64 ``[num_layers, 4]``), e.g. to all-reduce or send."""
        return self.counts.clone()

    @classmethod
    def from_tensor(cls, t: torch.Tensor, layer_ids: int | Sequence[int]) -> "AgreementCounter":
        """Inverse of :meth:`to_tensor` (the layer ids are not in the tensor: pass the same ones)."""
        return cls(layer_ids, counts=torch.as_tensor(t).to(torch.int64).clone())

    def all_reduce(self, group=None) -> "AgreementCounter":
        """Sum ``counts`` in place over ``group`` with ``torch.distributed`` (no-op when it is not
        initialised). Returns self."""
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.counts, op=dist.ReduceOp.SUM, group=group)
        return self

    def reset(self) -> None:
        self.counts.zero_()

    def to(self, device) -> "AgreementCounter":
        return AgreementCounter(self.layer_ids, counts=self.counts.to(device))

    # ----------------------------------------------------------------------------- reading
    def totals(self) -> dict[str, list[int]]:
        """Per-field per-layer counts as Python ints (one host sync)."""
        rows = self.counts.detach().cpu().tolist()
        return {name: [r[i] for r in rows] for i, name in enumerate(self.FIELDS)}

    def as_metrics(self, prefix: str = "r3bridge/") -> dict[str, float]:
        """One host sync. Keys (with ``prefix``):

        * ``agreement/mean``  sum(agree) / sum(compared) over layers (NaN when nothing compared)
        * ``agreement/layer_<id>``  agree / compared, for layers that compared any row
        * ``agreement/rows_compared``  sum(compared) ((row, layer) pairs)
        * ``coverage``  sum(replayed) / (sum(replayed) + sum(native)) (NaN when no row routed)
        * ``replayed_rows``, ``native_rows``  sums over layers ((row, layer) pairs)
        """
        t = self.totals()
        agree, comp = sum(t["agree"]), sum(t["compared"])
        rep, nat = sum(t["replayed"]), sum(t["native"])
        out = {f"{prefix}agreement/mean": _nan_div(agree, comp)}
        for lid, a, c in zip(self.layer_ids, t["agree"], t["compared"]):
            if c:
                out[f"{prefix}agreement/layer_{lid}"] = a / c
        out[f"{prefix}agreement/rows_compared"] = float(comp)
        out[f"{prefix}coverage"] = _nan_div(rep, rep + nat)
        out[f"{prefix}replayed_rows"] = float(rep)
        out[f"{prefix}native_rows"] = float(nat)
        return out

    def __repr__(self) -> str:
        return f"AgreementCounter(layer_ids={list(self.layer_ids)}, counts={self.counts.tolist()})"



# ===================================================================================== load
def expert_load(batch: ReplayBatch) -> torch.Tensor:
    """int64 ``[num_layers, num_experts]``: how many valid rows chose each expert, per layer
    (layer order of ``batch.layer_ids``). Each valid row adds ``topk`` counts per layer."""
    L, E = batch.num_layers, batch.num_experts
    r = batch.routes[batch.valid].to(torch.int64)                      # [N, L, K]
    if r.numel() == 0:
        return torch.zeros((L, E), dtype=torch.int64, device=batch.routes.device)
    flat = r + (torch.arange(L, device=r.device) * E)[None, :, None]
    return torch.bincount(flat.reshape(-1), minlength=L * E).reshape(L, E)


def tag_phase(metrics: Mapping[str, float], prefix: str, tag: str) -> dict[str, float]:
    """One schedule run's driver metrics named as every adapter logs them:
    ``{prefix}coverage`` -> ``{prefix}{tag}/coverage`` (tag ``old_log_prob`` or ``update``)."""
    return {f"{prefix}{tag}/{k[len(prefix):] if k.startswith(prefix) else k}": float(v) for k, v in metrics.items()}
