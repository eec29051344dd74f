"""Canonical rollouts and the model shape the conformance checks run on.

:class:`CanonicalRollout` is what an inference engine did for a batch of samples (multi-turn
calls that re-route earlier tokens differently, resubmits, dense layers anywhere, untracked tails,
aborted samples), and :meth:`CanonicalRollout.expected` the routes every adapter's codec must read
back.
:class:`ModelShape` is the one place the checks take the model's shape from: the harness model
(:meth:`ModelShape.model_spec`) and the rollouts (:meth:`ModelShape.rollout`) agree by
construction, and the defaults of :func:`make_rollout`, :class:`ModelShape` and
:class:`r3bridge.testing.harness.models.ModelSpec` are the same (4 experts, top-2, 4 layers).

Layer ids are 0-based global decoder layer indices everywhere (HF config index, Megatron
``layer_number - 1``): layer 0 is the first decoder layer, whichever stage holds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.batch.canonical import canonical_form
from r3bridge.batch.schema import ReplayBatch
from r3bridge.rollout.stitching import stitch

__all__ = ["ModelShape", "CanonicalRollout", "make_rollout"]


@dataclass
class CanonicalRollout:
    """What the inference engine did for a batch of samples.

    ``calls[i][t]``: the all-layers routes ``[rows, num_layers, K]`` (dense layers zero) engine call
    ``t`` of sample ``i`` returned, from row 0 of that call's prompt (every call re-sends the whole
    context: multi-turn prefill and resubmits), or ``None`` where the engine returned no routes
    (an aborted request: vLLM's ``routed_experts`` is ``None``; the sample's tokens still train,
    routed natively); ``call_tokens[i][t]`` the call's prompt + output;
    ``call_prompt_lens[i][t]`` the call's prompt length (a resubmit's prompt is the previous
    call's tokens). ``tokens[i]``: the sample's final trajectory (what the trainer sees),
    ``prompt_lens[i]`` its first prompt's length. docs/porting.md, "The canonical rollout"."""

    tokens: list[list[int]]
    calls: list[list[Optional[np.ndarray]]]
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

    @property
    def aborted(self) -> list[int]:
        """The samples no engine call returned routes for (``routes=None``): all their rows invalid."""
        return [i for i, calls in enumerate(self.calls) if all(c is None for c in calls)]

    def expected(self) -> ReplayBatch:
        """The canonical ReplayBatch: first-seen rows, MoE layers, one row per token (invalid where
        no call routed it: every row of an aborted sample), a final row without a route dropped;
        route kind ``"rollout"``; the model's top-k whatever the samples hold."""
        per = []
        empty = np.zeros((0, self.num_layers, self.topk), dtype=np.uint8)
        for i in range(self.batch_size):
            pieces = [ReplayBatch.from_ragged([(empty if c is None else c)[:, self.moe_layer_ids]],
                                              num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                              route_kind="rollout")
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


def make_rollout(seed: int = 0, *, batch_size: int = 5, num_experts: int = 4, topk: int = 2,
                 num_layers: int = 4, moe_layer_ids: Sequence[int] = (1, 2, 3), vocab: int = 100,
                 max_prompt: int = 9, max_turns: int = 3, dtype=np.uint8,
                 aborted: Sequence[int] = (), single_call: bool = False) -> CanonicalRollout:
    """Random rollouts covering single-turn, multi-turn (each later call re-routes the earlier
    context *differently*: only first-seen rows are right), resubmits (a call repeated over the
    same context), final tokens no call routed (observations appended after the last call) and,
    for the samples in ``aborted``, one call the engine aborted: a partial response whose routes
    are ``None``. ``single_call``: one engine call per sample (no multi-turn, no resubmit: a
    framework whose samples are one request each), tails and aborted samples as before."""
    rng = np.random.default_rng(seed)
    moe = list(moe_layer_ids)
    gone = {int(i) for i in aborted}
    if any(not 0 <= i < batch_size for i in gone):
        raise ValueError(f"aborted samples {sorted(gone)} must be in 0..{batch_size - 1}")
    tokens, calls, call_tokens, plens, call_plens = [], [], [], [], []
    for i in range(batch_size):
        p = int(rng.integers(2, max_prompt + 1))
        ctx = list(rng.integers(1, vocab, size=p))
        plens.append(p)
        sample_calls, sample_call_tokens, sample_plens = [], [], []
        turns = 1 if i == 0 or single_call else int(rng.integers(1, max_turns + 1))
        if i in gone:       # one call, aborted: its partial response trains, routed natively
            full = ctx + list(rng.integers(1, vocab, size=int(rng.integers(1, 6))))
            tokens.append([int(x) for x in full])
            calls.append([None])
            call_tokens.append([[int(x) for x in full]])
            call_plens.append([len(ctx)])
            continue
        for t in range(turns):
            gen = list(rng.integers(1, vocab, size=int(rng.integers(1, 6))))
            full = ctx + gen
            sample_calls.append(_routes(rng, len(full) - 1, num_layers, moe, num_experts, topk, dtype))
            sample_call_tokens.append(list(full))
            sample_plens.append(len(ctx))
            if i % 3 == 2 and t == 0 and not single_call:       # a resubmit of the same request: the prefix comes back again
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


@dataclass(frozen=True)
class ModelShape:
    """The MoE model the checks run on: ``num_layers`` decoder layers with ``num_experts`` experts,
    top-``topk``. Which layers are MoE: ``moe_layers``, their 0-based global ids (any dense
    layers anywhere: ``ModelShape(num_layers=6, moe_layers=(0, 2, 3, 5))`` has layers 1 and 4
    dense), else every layer from ``first_dense`` on (DeepSeek-V3's ``first_k_dense_replace``).
    Engines report every decoder layer (dense ones as zero rows)."""

    num_experts: int = 4
    topk: int = 2
    num_layers: int = 4
    first_dense: int = 1
    moe_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if not 0 < self.topk <= self.num_experts:
            raise ValueError(f"topk={self.topk} must be in 1..num_experts={self.num_experts}")
        if self.moe_layers is None:
            if not 0 <= self.first_dense < self.num_layers:
                raise ValueError(f"first_dense={self.first_dense} must leave a MoE layer of {self.num_layers}")
            return
        ids = tuple(int(i) for i in self.moe_layers)
        if not ids or list(ids) != sorted(set(ids)) or not all(0 <= i < self.num_layers for i in ids):
            raise ValueError(f"moe_layers={list(self.moe_layers)} must be ascending, distinct 0-based ids of the "
                             f"{self.num_layers} decoder layers (at least one)")
        if self.first_dense != 1:
            raise ValueError(f"give moe_layers ({list(ids)}) or first_dense ({self.first_dense}), not both")
        object.__setattr__(self, "moe_layers", ids)

    @property
    def moe_layer_ids(self) -> list[int]:
        """The MoE layers' 0-based global ids."""
        if self.moe_layers is not None:
            return list(self.moe_layers)
        return list(range(self.first_dense, self.num_layers))

    @property
    def moe_layer_freq(self) -> list[int]:
        """Megatron's per-layer pattern: 1 for a MoE layer, 0 for a dense one."""
        moe = set(self.moe_layer_ids)
        return [int(i in moe) for i in range(self.num_layers)]

    def rollout(self, seed: int, *, batch_size: int = 8, **kw: Any) -> "CanonicalRollout":
        """:func:`make_rollout` for this shape (``kw``: its other parameters, e.g. ``aborted``)."""
        return make_rollout(seed, batch_size=batch_size, num_experts=self.num_experts, topk=self.topk,
                            num_layers=self.num_layers, moe_layer_ids=self.moe_layer_ids, **kw)

    def model_spec(self, **overrides: Any) -> Any:
        """The harness :class:`~r3bridge.testing.harness.models.ModelSpec` of this shape, as checks 4-5
        build it: MoE-only layers (``attention="identity"``: context parallelism needs it without
        Transformer Engine), the all-to-all dispatcher with variable sequence lengths (packed
        micro-batches of different lengths through the pipeline). ``overrides``: other fields."""
        from r3bridge.testing.harness.models import ModelSpec

        kw: dict[str, Any] = dict(num_layers=self.num_layers, num_moe_experts=self.num_experts,
                                  moe_router_topk=self.topk,
                                  moe_layer_freq=self.moe_layer_freq,
                                  attention="identity", moe_token_dispatcher_type="alltoall",
                                  extra_config={"variable_seq_lengths": True})
        kw.update(overrides)
        return ModelSpec(**kw)
