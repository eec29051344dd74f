"""Train-vs-rollout log-prob mismatch: mean ``|d|``, mean ``d^2``, the k3 KL estimate and ``F(tau)``.

Core module: torch only; formulas in ``docs/metrics.md`` section 1. With ``d = train_logp -
rollout_logp`` over valid response tokens (each sequence's last valid token excluded by default, by
masking per row, never by ``torch.roll``). :func:`logprob_mismatch_sums` returns the raw sums as one
tensor so data-parallel ranks can all-reduce them before dividing (token-weighted, exact).
Public through :mod:`r3bridge.metrics`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from r3bridge.errors import ReplayError

__all__ = ["MetricsInputError", "logprob_mismatch", "logprob_mismatch_packed", "logprob_mismatch_sums",
           "mismatch_from_sums", "padded_response_mismatch", "DEFAULT_TAUS"]

DEFAULT_TAUS: tuple[float, ...] = (2.0, 5.0)


class MetricsInputError(ReplayError, ValueError):
    """Log-probs, masks or ``cu_seqlens`` handed to a metric have inconsistent shapes or values."""


def _tau_key(tau: float) -> str:
    return f"F{int(tau)}" if float(tau).is_integer() else f"F{tau:g}"


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


def padded_response_mismatch(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                             prefix: str = "r3bridge/") -> dict[str, float]:
    """:func:`logprob_mismatch` in a padded ``[B, max_response]`` response layout where column ``j``
    is response token ``j`` for both sides, the last sampled token included (its logits come from
    the row before: nothing to drop). ``rollout_logp`` / ``mask`` may be nested jagged (a framework
    that keeps responses unpadded): padded to ``train_logp``'s shape. Shapes that still differ
    give ``{}`` (nothing comparable)."""
    train = train_logp.float()

    def padded(x: torch.Tensor) -> torch.Tensor:
        x = x.to(train.device)
        return x.to_padded_tensor(0, output_size=tuple(train.shape)) if getattr(x, "is_nested", False) else x

    rollout, keep = padded(rollout_logp).float(), padded(mask).bool()
    if not train.shape == rollout.shape == keep.shape:
        return {}
    return logprob_mismatch(train, rollout, keep, exclude_last=False, prefix=prefix)
