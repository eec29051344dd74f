"""`ParallelLayout`: which tokens and which MoE layers each Megatron rank's routers see.

Pure arithmetic mirroring megatron-core 0.16's ``get_transformer_layer_offset`` /
``get_num_layers_to_build`` (tests compare against megatron-core itself), so the core never
imports Megatron. ``from_megatron`` reads a ``TransformerConfig`` without importing megatron at
module import time.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from r3bridge._validate import as_index, as_index_list
from r3bridge.errors import LayoutError

__all__ = ["ParallelLayout"]


def _parse_pipeline_layout(layout: str | Sequence[Sequence[str]]) -> list[list[str]]:
    """megatron's layout syntax ("Ettt|(tt|)*2,m|L") or list of lists -> flat stage list.

    Stage ``vp_stage * pp + pp_rank`` of the flat list; entries "embedding", "decoder", "mtp",
    "loss" (or their letters E, t, m, L).
    """
    letters = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
    if isinstance(layout, str):
        s = layout.replace(",", "")
        s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
        s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
        stages = []
        for stage in s.split("|"):
            bad = [c for c in stage if c not in letters]
            if bad:
                raise LayoutError(f"pipeline_model_parallel_layout: unknown layer letter {bad[0]!r} in {layout!r}")
            stages.append([letters[c] for c in stage])
        return stages
    out = []
    for row in layout:
        names = []
        for x in row:
            name = getattr(x, "name", x)          # accept megatron LayerType members too
            name = letters.get(name, str(name).strip().lower())
            if name not in letters.values():
                raise LayoutError(f"pipeline_model_parallel_layout: unknown layer type {x!r}")
            names.append(name)
        out.append(names)
    return out


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron parallel layout as far as routing replay cares.

    ``moe_layer_freq``: int N (layer i is MoE iff ``i % N == 0``, so layer 0 always is) or a 0/1
    list of length ``num_layers`` (first-k-dense models use ``[0]*k + [1]*(n-k)``).
    """

    num_layers: int
    moe_layer_freq: int | tuple[int, ...] = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool | None = None
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: Any = None
    ep: int = 1
    # a framework's FP8 THD packing (field notes 3): per-sequence alignment lcm(16, align),
    # total to align*128; not the model's config.fp8 (see from_megatron)
    fp8: bool = False
    _stages: list[list[str]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "tp", "cp", "pp", "ep", "vpp", "num_layers_in_first_pipeline_stage",
                     "num_layers_in_last_pipeline_stage"):
            v = getattr(self, name)
            if v is not None or name in ("num_layers", "tp", "cp", "pp", "ep"):
                object.__setattr__(self, name, as_index(v, what=f"ParallelLayout {name}", error=LayoutError))
        freq = self.moe_layer_freq
        if np.ndim(freq) == 0:          # int N, or one number of any type (checked by as_index)
            freq = as_index(freq, what="ParallelLayout moe_layer_freq", error=LayoutError)
            object.__setattr__(self, "moe_layer_freq", freq)
            if freq < 1:
                raise LayoutError(f"moe_layer_freq must be >= 1, got {freq}")
        else:
            freq = tuple(as_index_list(freq, what="ParallelLayout moe_layer_freq", error=LayoutError))
            object.__setattr__(self, "moe_layer_freq", freq)
            if len(freq) != self.num_layers:
                raise LayoutError(f"moe_layer_freq list has {len(freq)} entries for {self.num_layers} layers")
            if any(x not in (0, 1) for x in freq):
                raise LayoutError(f"moe_layer_freq list must hold 0/1, got {list(freq)}")
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers < 1:
            raise LayoutError(f"num_layers must be >= 1, got {self.num_layers}")
        sp = self.sequence_parallel
        if sp is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        elif sp and self.tp == 1:
            raise LayoutError("sequence_parallel=True needs tp > 1 (megatron refuses it too)")
        if self.vpp is not None:
            if self.pp == 1:
                raise LayoutError("vpp needs pp > 1 (megatron refuses virtual pipeline without pipeline)")
            if self.vpp < 1:
                raise LayoutError(f"vpp must be >= 1, got {self.vpp}")
        if self.pipeline_model_parallel_layout is not None:
            stages = _parse_pipeline_layout(self.pipeline_model_parallel_layout)
            if len(stages) % self.pp:
                raise LayoutError(f"pipeline_model_parallel_layout has {len(stages)} stages, not a multiple of pp={self.pp}")
            vp = len(stages) // self.pp
            if (self.vpp or 1) != vp:
                raise LayoutError(f"pipeline_model_parallel_layout implies vpp={vp}, layout says vpp={self.vpp}")
            ndec = sum(s.count("decoder") for s in stages)
            if ndec != self.num_layers:
                raise LayoutError(f"pipeline_model_parallel_layout has {ndec} decoder layers, num_layers={self.num_layers}")
            object.__setattr__(self, "_stages", stages)
        else:
            self._check_even_split()

    # ------------------------------------------------------------------------------ layers
    @property
    def vp_size(self) -> int:
        return self.vpp or 1

    def is_moe(self, layer: int) -> bool:
        f = self.moe_layer_freq
        return bool(f[layer]) if isinstance(f, tuple) else layer % f == 0

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe(i)]

    def layer_range(self, pp_rank: int, vp_stage: int = 0) -> range:
        """Global 0-based decoder layers built on (pp_rank, vp_stage)."""
        pp_rank = as_index(pp_rank, what="pp_rank", error=LayoutError)
        vp_stage = as_index(vp_stage, what="vp_stage", error=LayoutError)
        if not 0 <= pp_rank < self.pp:
            raise LayoutError(f"pp_rank {pp_rank} out of range for pp={self.pp}")
        if not 0 <= vp_stage < self.vp_size:
            raise LayoutError(f"vp_stage {vp_stage} out of range for vpp={self.vpp}")
        if self._stages is not None:
            flat = lambda v, p: self._stages[v * self.pp + p]  # noqa: E731
            off = sum(flat(v, p).count("decoder") for v in range(vp_stage + 1)
                      for p in range(self.pp if v < vp_stage else pp_rank))
            return range(off, off + flat(vp_stage, pp_rank).count("decoder"))
        off = self._offset(pp_rank, vp_stage)
        return range(off, off + self._num_to_build(pp_rank, vp_stage))

    def moe_layers(self, pp_rank: int, vp_stage: int = 0) -> list[int]:
        """Ascending global ids of the MoE layers on (pp_rank, vp_stage)."""
        return [i for i in self.layer_range(pp_rank, vp_stage) if self.is_moe(i)]

    # megatron-core 0.16 transformer_layer.get_transformer_layer_offset, for pp > 1
    def _offset(self, pp_rank: int, vp_stage: int) -> int:
        if self.pp == 1:
            return 0
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        vp = self.vpp
        if first is not None or last is not None:
            middle_stages = self.pp - (first is not None) - (last is not None)
            f, l_ = first or 0, last or 0
            middle_layers = self.num_layers - f - l_
            middle_rank = pp_rank if first is None else pp_rank - 1
            if vp is not None:
                fv, lv, mv = f // vp, l_ // vp, middle_layers // vp
                total = fv + mv + lv
                if pp_rank == 0:
                    return vp_stage * total
                return vp_stage * total + fv + middle_rank * (mv // middle_stages if middle_stages else 0)
            per = middle_layers // middle_stages if middle_stages > 0 else 0
            return 0 if pp_rank == 0 else middle_rank * per + f
        n = self.num_layers + self.account_for_embedding_in_pipeline_split + self.account_for_loss_in_pipeline_split
        per = n // self.pp
        first_chunk = pp_rank == 0 and vp_stage == 0
        if vp is not None:
            off = vp_stage * (n // vp) + pp_rank * (per // vp)
        else:
            off = pp_rank * per
        if self.account_for_embedding_in_pipeline_split and not first_chunk:
            off -= 1
        return off

    # megatron-core 0.16 transformer_block.get_num_layers_to_build
    def _num_to_build(self, pp_rank: int, vp_stage: int) -> int:
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        # No ``pp == 1`` shortcut: megatron counts the embedding/loss "layers" even without
        # pipelining (L + emb + loss, minus emb on the first and loss on the last chunk = L);
        # a shortcut to ``num_layers`` subtracted them once too often and refused valid configs.
        if first is not None or last is not None:
            left = self.num_layers - (first or 0) - (last or 0)
            stages_left = self.pp - (first is not None) - (last is not None)
            per = left // stages_left if stages_left > 0 else 0
            if pp_rank == 0 and first is not None:
                per = first
            if pp_rank == self.pp - 1 and last is not None:
                per = last
        else:
            per = (self.num_layers + self.account_for_embedding_in_pipeline_split
                   + self.account_for_loss_in_pipeline_split) // self.pp
        n = per // self.vpp if (self.vpp is not None and self.pp > 1) else per
        if self.account_for_embedding_in_pipeline_split and pp_rank == 0 and vp_stage == 0:
            n -= 1
        if self.account_for_loss_in_pipeline_split and pp_rank == self.pp - 1 and vp_stage == self.vp_size - 1:
            n -= 1
        return n

    def _check_even_split(self) -> None:
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if first is not None or last is not None:
            if self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split:
                raise LayoutError("uneven first/last stages cannot be combined with "
                                  "account_for_embedding/loss_in_pipeline_split (megatron refuses it)")
            left = self.num_layers - (first or 0) - (last or 0)
            stages_left = self.pp - (first is not None) - (last is not None)
            # megatron's TransformerConfig refuses empty first/last stages and middle stages
            # without layers; accepting them here described models megatron cannot build.
            for name, n in (("first", first), ("last", last)):
                if n is not None and n <= 0:
                    raise LayoutError(f"num_layers_in_{name}_pipeline_stage must be > 0, got {n}")
            if stages_left > 0 and left == 0:
                raise LayoutError(f"uneven pipeline: no layers left for {stages_left} middle stages")
            if left < 0 or (stages_left > 0 and left % stages_left) or (stages_left == 0 and left):
                raise LayoutError(f"uneven pipeline: {left} remaining layers cannot be split over {stages_left} middle stages")
            if self.vpp is not None:
                for n in (first or 0, last or 0, left // max(stages_left, 1)):
                    if n % self.vpp:
                        raise LayoutError(f"uneven pipeline: stage of {n} layers not divisible by vpp={self.vpp}")
        elif self.pp > 1:
            n = self.num_layers + self.account_for_embedding_in_pipeline_split + self.account_for_loss_in_pipeline_split
            if n % self.pp:
                raise LayoutError(f"{n} layers (embedding/loss included) not divisible by pp={self.pp}")
            if self.vpp is not None and (n // self.pp) % self.vpp:
                raise LayoutError(f"{n // self.pp} layers per stage not divisible by vpp={self.vpp}")
        total = sum(self._num_to_build(p, v) for p in range(self.pp) for v in range(self.vp_size))
        if total != self.num_layers:
            raise LayoutError(f"layout builds {total} decoder layers, num_layers={self.num_layers}")

    # ------------------------------------------------------------------------------ tokens
    @property
    def align(self) -> int:
        """Per-sequence padding multiple the frameworks' THD packers use (field notes 3)."""
        a = self.tp * self.cp * 2 if self.cp > 1 else self.tp
        return math.lcm(16, a) if self.fp8 else a

    @property
    def total_align(self) -> int:
        """Multiple the whole packed micro-batch is padded to (FP8 only, else 1).

        ``align * 128`` of the *layout* alignment (``tp*cp*2`` or ``tp``), not of the FP8
        per-sequence ``lcm(16, .)``: the FP8 THD packing rule pads sequences to ``lcm(16, a)`` and
        the micro-batch to ``a * 128``. Using the lcm here padded the last sequence differently
        from the trainer and shifted every SP slice boundary.
        """
        a = self.tp * self.cp * 2 if self.cp > 1 else self.tp
        return a * 128 if self.fp8 else 1

    @property
    def sp_split(self) -> int:
        """Number of contiguous slices the CP-local packed rows are split into across TP."""
        return self.tp if self.sequence_parallel else 1

    # ------------------------------------------------------------------------------ megatron
    @classmethod
    def from_megatron(cls, config: Any, *, cp: int | None = None, fp8: bool = False) -> "ParallelLayout":
        """Read a megatron-core ``TransformerConfig`` (duck-typed: any object with its fields).

        ``fp8`` is the *framework's* FP8 packing rule (sequences to
        ``lcm(16, align)``, the micro-batch to ``align * 128``), used only where a micro-batch is
        installed without ``cu_seqlens_padded``. It is never read from ``config.fp8``: the model
        computes in FP8 on whatever rows the framework packs (megatron-core pads FP8 GEMM inputs
        itself), and a framework may pack FP8 micro-batches without that padding. Guessing it from
        the config made the plan 640 rows where the router saw 608 (TE 2.20, 1 x H100). Pass the
        trainer's ``cu_seqlens_padded`` (every adapter does), or ``fp8=True`` for that rule.
        """
        g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
        freq = g("moe_layer_freq", 1)
        if freq is None:
            freq = 1
        layout = g("pipeline_model_parallel_layout")
        if layout is not None and not isinstance(layout, (str, list)):
            layout = getattr(layout, "input_data", layout)
        pp = g("pipeline_model_parallel_size", 1) or 1
        return cls(
            num_layers=g("num_layers"),
            moe_layer_freq=freq if isinstance(freq, int) else tuple(freq),
            tp=g("tensor_model_parallel_size", 1) or 1,
            cp=cp if cp is not None else (g("context_parallel_size", 1) or 1),
            pp=pp,
            vpp=g("virtual_pipeline_model_parallel_size") if pp > 1 else None,
            sequence_parallel=bool(g("sequence_parallel", False)) and (g("tensor_model_parallel_size", 1) or 1) > 1,
            num_layers_in_first_pipeline_stage=g("num_layers_in_first_pipeline_stage"),
            num_layers_in_last_pipeline_stage=g("num_layers_in_last_pipeline_stage"),
            account_for_embedding_in_pipeline_split=bool(g("account_for_embedding_in_pipeline_split", False)),
            account_for_loss_in_pipeline_split=bool(g("account_for_loss_in_pipeline_split", False)),
            pipeline_model_parallel_layout=layout,
            ep=g("expert_model_parallel_size", 1) or 1,
            fp8=bool(fp8),
        )
