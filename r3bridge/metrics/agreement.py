"""Route agreement: which rows and layers route to the same top-k set in two route sets.

Core module: torch only; formulas in ``docs/metrics.md`` sections 2-3. :func:`route_agreement`
compares two :class:`~r3bridge.ReplayBatch` es offline (rows matched by token position);
:class:`AgreementCounter` is the online version the Megatron driver feeds from inside the router
hook (counts stay on device, one ``[num_layers, 4]`` int64 tensor that can be all-reduced);
:func:`expert_load` counts each expert's rows. Public through :mod:`r3bridge.metrics`.
"""
from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch, ragged_arange
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError

__all__ = ["topk_sets_equal", "route_agreement", "AgreementReport", "AgreementCounter", "expert_load",
           "agreement_canaries"]

# Canaries for silent engine corruptions that keep every shape valid (issue 46): thresholds far
# from what routing noise gives (bf16 replay of a model's own routes agrees on ~0.97-1.0 of pairs,
# field notes 12 and 16), so a warning means a different computation, not noise.
COLLAPSED_AT_MOST = 0.25      # a layer whose agreement fell to this ...
HOLDING_AT_LEAST = 0.75       # ... while the median of the other layers holds this
PROMPT_FAR_WORSE = 4.0        # prompt rows differing this many times as often as generated rows ...
PROMPT_DIFFERING_AT_LEAST = 0.5   # ... and on at least half the prompt rows
CANARY_MIN_ROWS = 32          # rows a fraction needs before it is read


def agreement_canaries(per_layer: Mapping[int, tuple[int, int]], *,
                       prompt: Optional[tuple[int, int]] = None,
                       generated: Optional[tuple[int, int]] = None) -> list[str]:
    """Warnings naming the likely cause of two patterns routing noise does not make, from counts
    already computed (no pass over tokens): ``per_layer`` ``{layer id: (agreeing, compared)}``;
    ``prompt`` / ``generated``: ``(rows differing in any layer, rows compared)`` of prompt rows and
    of generated rows.

    * one layer near 0 while the others hold: that layer's rollout routes came from another
      computation, typically a speculative-decoding draft model writing its own layer into the
      capture (vLLM #48622, SGLang #26980);
    * prompt rows disagreeing far more than generated rows: the prompt was never run forward where
      its routes were captured (prefill / decode disaggregation or a KV connector, llm-d-router #1473).
    """
    out = []
    frac = {lid: a / c for lid, (a, c) in per_layer.items() if c >= CANARY_MIN_ROWS}
    if len(frac) >= 2:
        for lid, f in frac.items():
            others = statistics.median(v for k, v in frac.items() if k != lid)
            if f <= COLLAPSED_AT_MOST and others >= HOLDING_AT_LEAST:
                out.append(f"route agreement of layer {lid} collapsed to {f:.3f} while the other layers hold "
                           f"{others:.3f} (median): that layer's rollout routes came from another computation, most "
                           f"likely a speculative-decoding draft model writing its layer {lid} into the routes capture "
                           f"(vLLM #48622 before 0.26.0, SGLang #26980 before 0.5.15), or that layer's ids are mapped "
                           f"to the wrong layer")
    if prompt and generated and prompt[1] >= CANARY_MIN_ROWS and generated[1] >= CANARY_MIN_ROWS:
        p, g = prompt[0] / prompt[1], generated[0] / generated[1]
        if p >= PROMPT_DIFFERING_AT_LEAST and p >= PROMPT_FAR_WORSE * g:
            out.append(f"prompt rows differ from the trainer's routes on {p:.3f} of {prompt[1]} rows, generated rows "
                       f"on {g:.3f} of {generated[1]}: the prompt's routes were not computed where they were "
                       f"captured, most likely prefill / decode disaggregation or a KV connector serving the prompt's "
                       f"KV cache (llm-d-router #1473: the prompt rows hold a stale buffer); R3 must not replay them")
    return out


def _nan_div(num: float, den: float) -> float:
    return num / den if den else float("nan")


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
    # with route_agreement(prompt_lens=...): compared rows of prompt tokens / of generated tokens,
    # and how many of each differ in any layer
    prompt_rows_compared: int = 0
    prompt_rows_differing: int = 0
    generated_rows_compared: int = 0
    generated_rows_differing: int = 0

    def canaries(self) -> list[str]:
        """:func:`agreement_canaries` of this report (prompt vs generated only when
        ``prompt_lens`` was given)."""
        split = self.prompt_rows_compared + self.generated_rows_compared > 0
        return agreement_canaries(
            {lid: (a, self.rows_compared) for lid, a in zip(self.layer_ids, self.agree)},
            prompt=(self.prompt_rows_differing, self.prompt_rows_compared) if split else None,
            generated=(self.generated_rows_differing, self.generated_rows_compared) if split else None)

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
        ``.../tokens_differing_any_layer``, ``.../tokens_compared`` (tokens valid in both batches)."""
        out = {f"{prefix}agreement/mean": self.mean}
        if self.rows_compared:
            out.update({f"{prefix}agreement/layer_{lid}": v for lid, v in self.per_layer.items()})
        out[f"{prefix}agreement/tokens_differing_any_layer"] = self.tokens_differing_any_layer
        out[f"{prefix}agreement/tokens_compared"] = float(self.rows_compared)
        return out


def route_agreement(reference: ReplayBatch, other: ReplayBatch, *, prompt_lens: Optional[Sequence[int]] = None,
                    warn: bool = True) -> AgreementReport:
    """Per-layer top-k set agreement of two route sets over the same sequences.

    Sequence ``i`` of both batches is the same sample; rows are matched by token position
    (``start_rows[i] + j``), so batches with different coverage (e.g. rollout routes starting at
    the prompt offset vs routes recorded from token 0) are compared on their overlap. A row counts
    when it is valid in both. Layers are the intersection of both batches' ``layer_ids``.
    Raises when the sequence counts, ``num_experts`` or ``topk`` differ, or no layer is shared.
    ``prompt_lens`` (one per sequence): rows of tokens before it are prompt rows, counted apart from
    generated rows. ``warn``: emit :meth:`AgreementReport.canaries` as warnings.
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
    split = {}
    if prompt_lens is not None:
        if len(prompt_lens) != a.num_seqs:
            raise CoverageError(f"route_agreement: {len(prompt_lens)} prompt_lens for {a.num_seqs} sequences")
        seq = torch.repeat_interleave(torch.arange(a.num_seqs), n)
        pos = ragged_arange(lo, n)                                   # token position of each overlap row
        is_prompt = (pos < torch.as_tensor([int(p) for p in prompt_lens], dtype=torch.int64)[seq]).to(dev)[both]
        differ = (~eq).any(1) if eq.numel() else torch.zeros(0, dtype=torch.bool, device=dev)
        split = dict(prompt_rows_compared=int(is_prompt.sum()), prompt_rows_differing=int((differ & is_prompt).sum()),
                     generated_rows_compared=int((~is_prompt).sum()),
                     generated_rows_differing=int((differ & ~is_prompt).sum()))
    report = AgreementReport(
        layer_ids=tuple(layers),
        agree=tuple(int(x) for x in agree),
        rows_compared=int(both.sum()),
        rows_differing_any_layer=int((~eq).any(1).sum()) if eq.numel() else 0,
        rows_overlap=int(n.sum()),
        rows_valid_only_reference=int((va & ~vb).sum()),
        rows_valid_only_other=int((vb & ~va).sum()),
        layers_only_reference=tuple(x for x in reference.layer_ids if x not in other_ids),
        layers_only_other=tuple(x for x in other.layer_ids if x not in ref_ids),
        **split,
    )
    if warn:
        for message in report.canaries():
            warnings.warn(message, stacklevel=2)
    return report


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
        * ``agreement/pairs_compared``  sum(compared) ((token, layer) pairs)
        * ``coverage``  sum(replayed) / (sum(replayed) + sum(native)) (NaN when no row routed)
        * ``replayed_pairs``, ``native_pairs``  sums over layers ((token, layer) pairs)
        """
        t = self.totals()
        # the layer-collapse canary, from the counts already on the host
        for message in agreement_canaries({lid: (a, c) for lid, a, c in zip(self.layer_ids, t["agree"], t["compared"])}):
            warnings.warn(message, stacklevel=2)
        agree, comp = sum(t["agree"]), sum(t["compared"])
        rep, nat = sum(t["replayed"]), sum(t["native"])
        out = {f"{prefix}agreement/mean": _nan_div(agree, comp)}
        for lid, a, c in zip(self.layer_ids, t["agree"], t["compared"]):
            if c:
                out[f"{prefix}agreement/layer_{lid}"] = a / c
        out[f"{prefix}agreement/pairs_compared"] = float(comp)
        out[f"{prefix}coverage"] = _nan_div(rep, rep + nat)
        out[f"{prefix}replayed_pairs"] = float(rep)
        out[f"{prefix}native_pairs"] = float(nat)
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
