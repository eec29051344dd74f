"""What an evidence run is made of, as plain data (``run.json``): the model, the task, the warm
start, the GRPO options and the arms. The orchestrator (:mod:`r3bridge.demo.evidence`) writes it,
every arm process (:mod:`r3bridge.demo.grpo`) reads it, and waits here for the warm start's
weights (:func:`wait_for_warm_start`). Also the calibration's candidates (:class:`Candidate`: a
model shape and the warm start's router knobs) and the arm presets (:data:`ARM_PRESETS`)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from r3bridge.demo.task import AdditionTask
from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions
from r3bridge.errors import ReplayError

# R3w: R3 whose updates also replay the combine weights compute_log_prob gave the engine's experts at
# theta_old, router frozen (prime-rl #3523's idea; vLLM 0.24 returns no weights of its own)
MODES = ("off", "R2", "R3", "R3w")
ENGINES = ("hf", "vllm", "self")


@dataclass(frozen=True)
class Arm:
    """``name`` is the log file's stem, e.g. ``R3-s1``, ``R3-mb8-s0`` or ``floor-s0``.
    ``mini_batches``: updates per rollout batch for this arm (None: the run's ``GRPOOptions``)."""

    name: str
    mode: str
    seed: int
    engine: str
    mini_batches: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.engine not in ENGINES:
            raise ValueError(f"arm {self.name}: mode must be one of {MODES}, engine one of {ENGINES}")
        if self.mini_batches is not None and self.mini_batches < 1:
            raise ValueError(f"arm {self.name}: mini_batches must be >= 1, got {self.mini_batches}")


@dataclass(frozen=True)
class GRPOOptions:
    steps: int = 300
    prompts: int = 32
    group: int = 8
    mini_batches: int = 4
    logprob_micro_batches: int = 2
    lr: float = 1e-4
    clip: float = 0.2
    grad_clip: float = 1.0
    temperature: float = 1.0
    device: str = "cpu"
    trainer_dtype: str = "fp32"     # "bf16": bf16 parameters + fp32 main weights (Megatron's recipe)
    layer_spec: str = "local"       # "te": Transformer Engine layer spec (THD input; cuda only)
    checkpoint_every: int = 100     # steps between resumable checkpoints (0: never)
    # > 0: the trainer keeps the warm start's router losses (load balancing, z-loss) during GRPO, times
    # this, as megatron's moe_aux_loss_coeff / moe_z_loss_coeff (r3bridge.demo.grpo.trainer_router_losses),
    # as Megatron RL jobs keep their pre-training coefficient; 0: GRPO's loss alone
    router_losses: float = 0.0
    vllm_kv_cache_mb: int = 64      # 256 samples x 14 tokens of this model need about 8 MB

    def __post_init__(self) -> None:
        n = self.prompts * self.group
        if n % self.mini_batches or n % self.logprob_micro_batches:
            raise ValueError(f"{self.prompts} x {self.group} samples must split into {self.mini_batches} mini-batches "
                             f"and {self.logprob_micro_batches} log-prob micro-batches")
        if self.trainer_dtype not in ("fp32", "bf16") or self.layer_spec not in ("local", "te"):
            raise ValueError("trainer_dtype must be fp32 or bf16, layer_spec local or te")
        if not self.router_losses >= 0:
            raise ValueError(f"router_losses must be >= 0 (a scale of the warm start's), got {self.router_losses!r}")


class EvidenceError(ReplayError, RuntimeError):
    """The evidence run cannot go on (bad options, a missing warm start, no arm left running)."""


@dataclass
class RunConfig:
    shape: EvidenceModelShape = field(default_factory=EvidenceModelShape)
    task: AdditionTask = field(default_factory=AdditionTask)
    warm: WarmStartOptions = field(default_factory=WarmStartOptions)
    grpo: GRPOOptions = field(default_factory=GRPOOptions)
    arms: list[Arm] = field(default_factory=list)
    deadline: Optional[float] = None       # unix time: no arm starts a step it cannot finish before it
    resume: bool = False
    # a file the arms wait for, trainer built, before their first step (the calibration opens it
    # once every candidate is ready, so that their steps, timed and GPU-measured, run side by side)
    start_gate: Optional[str] = None
    # where the arms came from, for merging the arms of several runs (sessions) into one table:
    # the sha256 of the warm start's state.pt they all load, and the source commit (None: unknown)
    warm_start_sha256: Optional[str] = None
    commit: Optional[str] = None
    # what the arms ran on (evidence.run_versions: the packages whose kernels compute a step, and
    # the GPU): runs merge only where these are the same
    versions: Optional[dict[str, Optional[str]]] = None

    def __post_init__(self) -> None:
        n = self.grpo.prompts * self.grpo.group
        for a in self.arms:
            if a.mini_batches is not None and n % a.mini_batches:
                raise ValueError(f"arm {a.name}: {self.grpo.prompts} x {self.grpo.group} samples must split into "
                                 f"{a.mini_batches} mini-batches")

    def mini_batches(self, arm: Arm) -> int:
        return self.grpo.mini_batches if arm.mini_batches is None else arm.mini_batches

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise EvidenceError(f"no arm {name!r} in this run ({', '.join(a.name for a in self.arms)})")

    def save(self, root: Path) -> None:
        # atomic: the arm processes may read run.json while the orchestrator adds the warm start's sha256
        (root / "run.json.tmp").write_text(json.dumps(asdict(self), indent=1))
        (root / "run.json.tmp").replace(root / "run.json")

    @classmethod
    def load(cls, root: Path) -> "RunConfig":
        d = json.loads((root / "run.json").read_text())
        return cls(shape=EvidenceModelShape(**d["shape"]), task=AdditionTask(**d["task"]), warm=WarmStartOptions(**d["warm"]),
                   grpo=GRPOOptions(**d["grpo"]), arms=[Arm(**a) for a in d["arms"]], deadline=d["deadline"],
                   resume=d["resume"], start_gate=d.get("start_gate"), warm_start_sha256=d.get("warm_start_sha256"),
                   commit=d.get("commit"), versions=d.get("versions"))


# ------------------------------------------------------------------------------ the warm start folder
# warmstart/ holds state.pt (HF names, fp32), stats.json (warm_start's) and spec.json: what the
# weights were trained for (shape, task, warm-start options) and state.pt's sha256, so a later
# run (another session) can reuse the folder and refuse it for another model or task
WARM_START_FILES = ("spec.json", "stats.json", "state.pt")      # state.pt last: the arms wait for it


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_warm_start_spec(folder: Path, run: RunConfig, state: Path) -> dict:
    """``folder/spec.json`` for the weights in ``state`` (state.pt, or its copy before the rename); returns it."""
    spec = {"shape": asdict(run.shape), "task": asdict(run.task), "warm": asdict(run.warm),
            "state_sha256": sha256_of(state), "state_bytes": state.stat().st_size}
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    return spec


def read_warm_start(folder: Path) -> dict:
    """A warm start folder's spec.json, after checking that its files are there and that state.pt
    is the one the spec names (a truncated or swapped copy is refused)."""
    missing = [n for n in WARM_START_FILES if not (folder / n).is_file()]
    if missing:
        raise EvidenceError(f"warm start {folder}: {', '.join(missing)} missing (a warm start folder holds "
                            f"{', '.join(WARM_START_FILES)}; spec.json is written by runs of this version)")
    spec = json.loads((folder / "spec.json").read_text())
    digest = sha256_of(folder / "state.pt")
    if digest != spec["state_sha256"]:
        raise EvidenceError(f"warm start {folder}: state.pt's sha256 {digest[:12]} is not spec.json's "
                            f"{spec['state_sha256'][:12]} (a different or damaged file)")
    return spec


def mismatches(want: dict, have: dict, prefix: str) -> list[str]:
    """``prefix.field (a vs b)`` for each field of ``want`` whose value in ``have`` differs."""
    return [f"{prefix}.{k} ({want[k]!r} vs {have.get(k)!r})" for k in want if have.get(k) != want[k]]


_ARM_NAME = re.compile(r"^(?P<mode>[A-Za-z0-9]+?)(?:-mb(?P<mb>\d+))?-s(?P<seed>\d+)$")

# --arms presets. "issue49": the run of issue 49 - off / R2 / R3 / R3w for seeds 0 and 1 at the
# run's mini-batches (4), the noise floor, and R2 / R3 at 1 and 8 mini-batches (seed 0), the pair
# that tests arXiv 2512.01374's "R2 better at few mini-batches, R3 at many" (13 arms)
ARM_PRESETS: dict[str, tuple[str, ...]] = {
    "issue49": ("off-s0", "R2-s0", "R3-s0", "R3w-s0", "off-s1", "R2-s1", "R3-s1", "R3w-s1", "floor-s0",
                "R2-mb1-s0", "R3-mb1-s0", "R2-mb8-s0", "R3-mb8-s0"),
    "small": ("off-s0", "R3-s0", "floor-s0"),
}


def parse_arm(name: str, engine: str) -> Arm:
    """``<mode>[-mb<N>]-s<seed>`` (``R3-mb8-s0``: R3, 8 mini-batches, seed 0) or ``floor-s<seed>``
    (R3 whose engine is the trainer itself) -> the arm; the mini-batch count is in the name, so
    the log file says which arm it was."""
    m = _ARM_NAME.match(name)
    if not m:
        raise ValueError(f"arm {name!r}: expected <mode>[-mb<N>]-s<seed> (e.g. R3-s0, R2-mb8-s1) or floor-s<seed>")
    mode, mb = m.group("mode"), m.group("mb")
    if mode == "floor":
        return Arm(name, "R3", int(m.group("seed")), "self", None if mb is None else int(mb))
    if mode not in MODES:
        raise ValueError(f"arm {name!r}: mode {mode!r} is not one of {', '.join(MODES)} (or floor)")
    return Arm(name, mode, int(m.group("seed")), engine, None if mb is None else int(mb))


def arms_from_spec(spec: str, engine: str) -> list[Arm]:
    """``--arms``: a preset's name (:data:`ARM_PRESETS`) or comma-separated arm names."""
    names = ARM_PRESETS.get(spec.strip()) or tuple(x.strip() for x in spec.split(",") if x.strip())
    if not names:
        raise ValueError(f"--arms {spec!r}: no arm named (presets: {', '.join(ARM_PRESETS)})")
    if len(set(names)) != len(names):
        raise ValueError(f"--arms {spec!r}: an arm is named twice")
    return [parse_arm(n, engine) for n in names]


def make_arms(modes: Sequence[str], seeds: Sequence[int], engine: str, floor: bool) -> list[Arm]:
    """``<mode>-s<seed>`` per mode and seed with the run's engine, plus ``floor-s<first seed>``: R3
    with the trainer's own forward as the engine (r3bridge.demo.grpo)."""
    arms = [Arm(f"{m}-s{s}", m, int(s), engine) for s in seeds for m in modes]
    if floor:
        arms.append(Arm(f"floor-s{seeds[0]}", "R3", int(seeds[0]), "self"))
    return arms


@dataclass(frozen=True)
class Candidate:
    """One model the calibration tries: a shape and the warm start's router knobs. ``name`` is
    its spec, e.g. ``L12-E64-k8-aux0.05-z0.001`` (:func:`parse_candidate`). ``trainer_dtype``
    (None: the run's) lets one calibration weigh a bf16 trainer against an fp32 one on one shape."""

    name: str
    shape: EvidenceModelShape
    aux_loss: float
    router_z_loss: float
    lr: Optional[float] = None
    trainer_dtype: Optional[str] = None

    def warm(self, base: WarmStartOptions) -> WarmStartOptions:
        return dataclasses.replace(base, aux_loss=self.aux_loss, router_z_loss=self.router_z_loss,
                                   lr=base.lr if self.lr is None else self.lr)

    def grpo(self, base: GRPOOptions) -> GRPOOptions:
        return base if self.trainer_dtype is None else dataclasses.replace(base, trainer_dtype=self.trainer_dtype)


_CANDIDATE_KEYS = {"L": ("layers", int), "E": ("experts", int), "k": ("topk", int), "h": ("hidden", int),
                   "f": ("moe_ffn", int), "aux": ("aux_loss", float), "z": ("router_z_loss", float),
                   "lr": ("lr", float)}
_CANDIDATE_PART = re.compile(r"(?P<key>aux|lr|L|E|k|h|f|z)(?P<value>[0-9][0-9.]*(?:e[+-]?[0-9]+)?)")
_CANDIDATE_SPLIT = re.compile(r"-(?![0-9])")     # "z1e-3": the minus of an exponent does not split

# The calibration's default candidates, cheapest first (step time grows with layers x experts:
# megatron's local spec runs a layer's experts one after the other, and the step is Python-bound).
# On the H200 (vLLM 0.24 bf16 engine against the bf16 trainer, 19 candidates over three sessions,
# docs/evidence.md) route agreement falls with the router's margin (k-th minus (k+1)-th logit) and
# with the expert count: calibration 4's L4-E64-k8 with aux 1.0 + z 0.1 (margin median 0.029) was
# the first under 0.95 (0.949), L4-E64-k8 aux 0.4 + z 0.05 (0.038) 0.959, every E32 / E48 model
# 0.967-0.990. Over its 300 GRPO steps off's agreement rose to 0.962 (margins widened to 0.04):
# hence --max-agreement 0.94 in the next calibration's command, and calibration 5's candidates
# push past it: stronger balancing and z-loss at L4-E64, more experts at the same carried size
# (96 at 3 layers; 96 and 128 with 64-wide experts at 4 layers), and last, the fallback chosen only
# if no bf16 trainer gets there, calibration 4's best with an fp32 trainer against the bf16 engine
# (calibration 4 measured that gap on L6-E32: 0.9674 fp32 vs calibration 3's 0.9746 bf16). Every
# warm start's fp32 state.pt is under evidence.sh's 60 MiB (37.7-55.3 MiB), so it can be carried.
DEFAULT_CANDIDATES = ("L4-E64-k8-aux2.0-z0.1", "L4-E64-k8-aux1.0-z0.2", "L3-E96-k8-aux1.0-z0.1",
                      "L4-E96-k8-f64-aux1.0-z0.1", "L4-E128-k8-f64-aux1.0-z0.1", "L4-E64-k8-aux1.0-z0.1-fp32")


def parse_candidate(spec: str, base: EvidenceModelShape, warm: WarmStartOptions) -> Candidate:
    """``L<layers>-E<experts>-k<topk>-h<hidden>-f<moe ffn>-aux<coef>-z<coef>-lr<lr>[-dense][-fp32|-bf16]``,
    any part left out taken from ``base`` / ``warm`` (the run's own options); ``fp32`` / ``bf16``: the
    trainer's dtype for this candidate (GRPOOptions.trainer_dtype; the warm start is the same)."""
    shape: dict = {}
    knobs: dict = {"aux_loss": warm.aux_loss, "router_z_loss": warm.router_z_loss, "lr": None, "trainer_dtype": None}
    for part in _CANDIDATE_SPLIT.split(spec.strip()):
        if part == "dense":
            shape["dense_first"] = True
            continue
        if part in ("fp32", "bf16"):
            knobs["trainer_dtype"] = part
            continue
        m = _CANDIDATE_PART.fullmatch(part)
        if not m:
            raise ValueError(f"candidate {spec!r}: cannot read {part!r} (parts: L<layers> E<experts> k<topk> "
                             f"h<hidden> f<moe ffn> aux<coef> z<coef> lr<lr> dense fp32 bf16, joined by '-')")
        field_name, kind = _CANDIDATE_KEYS[m.group("key")]
        try:
            value = kind(m.group("value"))
        except ValueError:
            raise ValueError(f"candidate {spec!r}: {part!r} is not a number") from None
        (knobs if field_name in knobs else shape)[field_name] = value
    try:
        cand = Candidate(spec.strip(), dataclasses.replace(base, **shape), **knobs)
        cand.warm(warm)          # validates the knobs
    except ValueError as e:
        raise ValueError(f"candidate {spec!r}: {e}") from None
    return cand


def wait_for_gate(gate: Path, deadline: Optional[float]) -> None:
    """Block an arm until ``gate`` exists (:attr:`RunConfig.start_gate`) or ``deadline`` passed."""
    while not gate.exists():
        if deadline and time.time() > deadline:
            raise EvidenceError(f"the wall-clock bound passed before {gate} opened")
        time.sleep(0.2)


def wait_for_warm_start(root: Path, deadline: Optional[float]) -> None:
    """Block an arm process until the run folder holds the warm start's weights (or says it failed,
    or ``deadline`` passed): the arms start while the warm start still trains."""
    state, failed = root / "warmstart" / "state.pt", root / "warmstart" / "FAILED"
    while not state.exists():
        if failed.exists():
            raise EvidenceError(f"the warm start failed: {failed.read_text().strip()}")
        if deadline and time.time() > deadline:
            raise EvidenceError("the wall-clock bound passed before the warm start finished")
        time.sleep(0.5)
