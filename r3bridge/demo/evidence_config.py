"""What an evidence run is made of, as plain data (``run.json``): the model, the task, the warm
start, the GRPO options and the arms. The orchestrator (:mod:`r3bridge.demo.evidence`) writes it,
every arm process (:mod:`r3bridge.demo.grpo`) reads it, and waits here for the warm start's
weights (:func:`wait_for_warm_start`)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from r3bridge.demo.task import AdditionTask
from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions
from r3bridge.errors import ReplayError

MODES = ("off", "R2", "R3")
ENGINES = ("hf", "vllm", "self")


@dataclass(frozen=True)
class Arm:
    """``name`` is the log file's stem, e.g. ``R3-s1`` or ``floor-s0``."""

    name: str
    mode: str
    seed: int
    engine: str

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.engine not in ENGINES:
            raise ValueError(f"arm {self.name}: mode must be one of {MODES}, engine one of {ENGINES}")


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
    vllm_kv_cache_mb: int = 64      # 256 samples x 14 tokens of this model need about 8 MB

    def __post_init__(self) -> None:
        n = self.prompts * self.group
        if n % self.mini_batches or n % self.logprob_micro_batches:
            raise ValueError(f"{self.prompts} x {self.group} samples must split into {self.mini_batches} mini-batches "
                             f"and {self.logprob_micro_batches} log-prob micro-batches")
        if self.trainer_dtype not in ("fp32", "bf16") or self.layer_spec not in ("local", "te"):
            raise ValueError("trainer_dtype must be fp32 or bf16, layer_spec local or te")


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

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise EvidenceError(f"no arm {name!r} in this run ({', '.join(a.name for a in self.arms)})")

    def save(self, root: Path) -> None:
        (root / "run.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, root: Path) -> "RunConfig":
        d = json.loads((root / "run.json").read_text())
        return cls(shape=EvidenceModelShape(**d["shape"]), task=AdditionTask(**d["task"]), warm=WarmStartOptions(**d["warm"]),
                   grpo=GRPOOptions(**d["grpo"]), arms=[Arm(**a) for a in d["arms"]], deadline=d["deadline"],
                   resume=d["resume"])


def make_arms(modes: Sequence[str], seeds: Sequence[int], engine: str, floor: bool) -> list[Arm]:
    """``<mode>-s<seed>`` per mode and seed with the run's engine, plus ``floor-s<first seed>``: R3
    with the trainer's own forward as the engine (r3bridge.demo.grpo)."""
    arms = [Arm(f"{m}-s{s}", m, int(s), engine) for s in seeds for m in modes]
    if floor:
        arms.append(Arm(f"floor-s{seeds[0]}", "R3", int(seeds[0]), "self"))
    return arms


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
