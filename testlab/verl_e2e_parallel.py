"""verl's whole job on several ranks (tests and device runs only): the trainer's parallel layout
from the environment, verl's overrides for it, and which (sequence, token) each rank's router rows
hold.

Knobs (environment, read by :meth:`Parallel.from_env`; all default to one GPU, no parallelism):

* ``R3E2E_GPUS``: ranks (``trainer.n_gpus_per_node`` and Ray's GPUs; the HF rollout servers take
  none, one per rollout replica);
* ``R3E2E_TP``, ``R3E2E_EP``, ``R3E2E_ETP``, ``R3E2E_PP``, ``R3E2E_VPP``, ``R3E2E_CP``: verl's
  ``actor_rollout_ref.actor.megatron.*_parallel_size`` (the reference model inherits them: verl's
  ``ref.megatron`` interpolates the actor's);
* ``R3E2E_SP``: ``1`` / ``0``, ``sequence_parallel`` (verl's default: on; verl turns it off itself
  at TP 1);
* ``R3E2E_OVERRIDES``: more verl overrides, space-separated, applied last (e.g. a smaller Ray
  object store when several jobs share a machine).

Router rows (what the checker needs, independent of r3bridge's own packing code): verl packs each
micro-batch THD, every sequence padded to a multiple of ``tp * cp * (2 if cp > 1)``
(``preprocess_thd_engine``); with sequence parallelism TP rank ``t`` routes the contiguous rows
``[t * n / tp, (t + 1) * n / tp)`` of that packed stream, without it every TP rank routes all of
them; every pipeline stage routes the same rows (its own layers), expert and data parallelism do
not change a router's rows. Context parallelism (a zigzag per sequence) is not handled here:
:func:`rank_rows` raises.

verl 0.9.1 hands the first pipeline stage the packed ids with ``cu_seqlens_q`` equal to the padded
offsets (``models/mcore/util.py``: both are ``cu_seqlens_padded``), so a record of that stage knows
only padded lengths when the alignment is above 1: :func:`resolve_lengths` finds each sequence's
real length from the rollout server's calls. Later stages get verl's nested (unpadded) ids.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

ENV = ("R3E2E_GPUS", "R3E2E_TP", "R3E2E_EP", "R3E2E_ETP", "R3E2E_PP", "R3E2E_VPP", "R3E2E_CP", "R3E2E_SP",
       "R3E2E_OVERRIDES")
MEGATRON = "actor_rollout_ref.actor.megatron"


@dataclass(frozen=True)
class Parallel:
    gpus: int = 1
    tp: int = 1
    ep: int = 1
    etp: Optional[int] = None     # None: verl's default (megatron: = tp)
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    sp: Optional[bool] = None     # None: verl's default (on, off at tp 1)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Parallel":
        def num(name: str, default: Optional[int]) -> Optional[int]:
            v = env.get(name, "").strip()
            return int(v) if v else default

        sp = env.get("R3E2E_SP", "").strip()
        par = cls(gpus=num("R3E2E_GPUS", 1), tp=num("R3E2E_TP", 1), ep=num("R3E2E_EP", 1), etp=num("R3E2E_ETP", None),
                  pp=num("R3E2E_PP", 1), vpp=num("R3E2E_VPP", None), cp=num("R3E2E_CP", 1),
                  sp=None if not sp else sp not in ("0", "false", "False"))
        model = par.tp * par.pp * par.cp
        if par.gpus % model or par.gpus % (par.ep * (par.etp or par.tp) * par.pp):
            raise ValueError(f"R3E2E_*: {par} does not fit {par.gpus} rank(s) (tp*pp*cp={model}, "
                             f"ep*etp*pp={par.ep * (par.etp or par.tp) * par.pp})")
        return par

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 and (self.sp is None or self.sp)

    @property
    def label(self) -> str:
        """e.g. ``tp2_sp``, ``ep2``, ``tp2_pp2``; ``tp1`` for one rank."""
        parts = [f"{n}{v}" for n, v in (("tp", self.tp), ("ep", self.ep), ("pp", self.pp), ("vpp", self.vpp or 1),
                                         ("cp", self.cp)) if v > 1]
        if self.sequence_parallel:
            parts.insert(1, "sp")
        return "_".join(parts) or "tp1"

    def overrides(self) -> list[str]:
        """verl's command-line overrides for this layout (the reference model inherits them)."""
        out = [f"{MEGATRON}.tensor_model_parallel_size={self.tp}", f"{MEGATRON}.expert_model_parallel_size={self.ep}",
               f"{MEGATRON}.pipeline_model_parallel_size={self.pp}", f"{MEGATRON}.context_parallel_size={self.cp}",
               f"trainer.n_gpus_per_node={self.gpus}", f"+ray_kwargs.ray_init.num_gpus={self.gpus}"]
        if self.etp is not None:
            out.append(f"{MEGATRON}.expert_tensor_parallel_size={self.etp}")
        if self.vpp is not None:
            out.append(f"{MEGATRON}.virtual_pipeline_model_parallel_size={self.vpp}")
        if self.sp is not None:
            out.append(f"{MEGATRON}.sequence_parallel={self.sp}")
        return out + os.environ.get("R3E2E_OVERRIDES", "").split()


def apply_overrides(cmd: list[str], overrides: Sequence[str]) -> list[str]:
    """``cmd`` with each override's key set to the override (Hydra refuses a key given twice)."""
    def key(arg: str) -> str:
        return arg.split("=", 1)[0].lstrip("+")

    new = {key(o): o for o in overrides}
    out = [new.pop(key(a)) if key(a) in new else a for a in cmd]
    return out + list(new.values())


def rank_info() -> dict[str, Any]:
    """This process's coordinates as the router sees them (megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "cp": ps.get_context_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank()}


def alignment(batch: Mapping[str, Any]) -> int:
    """verl's per-sequence THD alignment for the record's rank (``preprocess_thd_engine``)."""
    par = batch.get("parallel") or {}
    tp, cp = int(par.get("tp", 1)), int(par.get("cp", 1))
    return tp * cp * (2 if cp > 1 else 1)


def rank_rows(batch: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """(sequence index, token position) of every router row of the record's rank, -1 on padding."""
    par = batch.get("parallel") or {}
    if int(par.get("cp", 1)) > 1:
        raise NotImplementedError("verl e2e checker: context parallelism (zigzag rows) is not mapped")
    seq: list[int] = []
    pos: list[int] = []
    for i, (n, pad) in enumerate(zip(batch["lens"], batch["padded"])):
        seq += [i] * n + [-1] * (pad - n)
        pos += list(range(n)) + [-1] * (pad - n)
    tp = int(par.get("tp", 1))
    if tp > 1 and par.get("sp"):
        if len(seq) % tp:
            raise AssertionError(f"packed stream of {len(seq)} rows is not a multiple of tp={tp}")
        part = len(seq) // tp
        a = int(par["tp_rank"]) * part
        seq, pos = seq[a:a + part], pos[a:a + part]
    return seq, pos


def resolve_lengths(batch: dict[str, Any], call_tokens: Sequence[Sequence[int]], pad_id: int = 0) -> None:
    """Set ``batch["seqs"]`` / ``batch["lens"]`` to the real sequences where the record holds only
    padded ones (the first stage's packed ids at an alignment above 1). A sequence's real length L
    lies in ``(padded - align, padded]`` with pad ids after it; the L kept is the one where the
    sequence equals a rollout call's prompt + output, else the longest whose tokens continue a call
    (as :func:`testlab.verl_e2e.trajectories` links them), else the padded length (the check then
    fails loudly on that sequence)."""
    if batch.get("lens_exact", True) or alignment(batch) == 1:
        return
    align = alignment(batch)
    exact = {tuple(t) for t in call_tokens}
    seqs, lens = [], []
    for s in batch["seqs"]:
        s = list(s)
        cands = [n for n in range(len(s), max(len(s) - align, 0), -1) if all(t == pad_id for t in s[n:])]
        pick = next((n for n in cands if tuple(s[:n]) in exact), None)
        if pick is None:
            pick = next((n for n in cands if any(_continues(s[:n], c) for c in call_tokens)), len(s))
        seqs.append(s[:pick])
        lens.append(pick)
    batch["seqs"], batch["lens"], batch["lens_exact"] = seqs, lens, True


def _continues(seq: Sequence[int], call: Sequence[int]) -> bool:
    n = min(len(seq), len(call))
    return n > 0 and list(seq[:n]) == list(call[:n])


def by_process(recs: Sequence[dict]) -> dict[int, list[dict]]:
    """Router-call records per process (one rank each), each in call order."""
    out: dict[int, list[dict]] = {}
    for r in sorted(recs, key=lambda r: (r["pid"], r["time"])):
        out.setdefault(r["pid"], []).append(r)
    return out


__all__ = ["ENV", "Parallel", "apply_overrides", "rank_info", "rank_rows", "resolve_lengths", "by_process", "alignment"]
