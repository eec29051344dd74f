"""`replay_mode` and what it means in each trainer phase: the one place R2/R3 semantics live.

Every adapter asks :func:`phase_plan` what to do in ``compute_log_prob``, the update passes and
the reference-model pass, so the frameworks cannot drift apart (verl 0.9.1 replayed rollout routes
under R2).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, Mapping, Optional

from r3bridge.engine_settings import check_engine_version_setting
from r3bridge.errors import ConfigError
from r3bridge.layer_axis import check_layer_axis
from r3bridge.provenance import CHECK_MODES
from r3bridge.replay_policy import check_policy

ENV_CONFIG = "R3BRIDGE_CONFIG"         # JSON of the r3bridge section
ENV_MODE = "R3BRIDGE_REPLAY_MODE"      # shortcut: only replay_mode
SOURCE_CONFIG = "config"
SOURCE_DEFAULT = "default"

__all__ = ["ReplayMode", "Phase", "Action", "PhasePlan", "ReplayConfig", "phase_plan"]


class ReplayMode(str, Enum):
    OFF = "off"
    R2 = "R2"   # record the trainer's own routes in compute_log_prob, replay them in the updates
    R3 = "R3"   # replay the rollout engine's routes in every trainer forward

    def __str__(self) -> str:    # "off", not "ReplayMode.OFF" (OmegaConf and f-strings use str())
        return self.value

    @classmethod
    def parse(cls, value: Any) -> "ReplayMode":
        """``off`` / ``R2`` / ``R3`` in any case. ``disabled`` (verl's spelling of off) and ``false``
        also mean off: YAML 1.1 reads an unquoted ``off`` as the boolean False, and OmegaConf turns
        that into the string ``"False"`` for a string field."""
        if isinstance(value, cls):
            return value
        if value is False:
            return cls.OFF
        s = str(value).strip()
        if s.lower() in _OFF_SPELLINGS:
            return cls.OFF
        for m in cls:
            if s.lower() == m.value.lower():
                return m
        raise ConfigError(f"replay_mode must be one of off, R2, R3 (off also spelled disabled or false); got {value!r}")


_OFF_SPELLINGS = ("off", "disabled", "false")


class Phase(str, Enum):
    OLD_LOG_PROB = "compute_log_prob"   # forward-only, weights theta_old
    UPDATE = "update"                   # forward + backward, every mini-batch
    REF_LOG_PROB = "ref_log_prob"       # reference model: never replays


class Action(str, Enum):
    NATIVE = "native"
    RECORD = "record"
    REPLAY = "replay"


@dataclass(frozen=True)
class PhasePlan:
    action: Action
    source: str | None   # which routes to replay: "rollout" or "recorded"


_PLANS: dict[tuple[ReplayMode, Phase], PhasePlan] = {
    (ReplayMode.OFF, Phase.OLD_LOG_PROB): PhasePlan(Action.NATIVE, None),
    (ReplayMode.OFF, Phase.UPDATE): PhasePlan(Action.NATIVE, None),
    (ReplayMode.R2, Phase.OLD_LOG_PROB): PhasePlan(Action.RECORD, None),
    (ReplayMode.R2, Phase.UPDATE): PhasePlan(Action.REPLAY, "recorded"),
    (ReplayMode.R3, Phase.OLD_LOG_PROB): PhasePlan(Action.REPLAY, "rollout"),
    (ReplayMode.R3, Phase.UPDATE): PhasePlan(Action.REPLAY, "rollout"),
}


def phase_plan(mode: ReplayMode | str, phase: Phase | str) -> PhasePlan:
    """What the driver does in ``phase`` under ``mode``. The reference model never replays."""
    m = ReplayMode.parse(mode)
    try:
        p = Phase(phase)
    except ValueError:   # (was a bare ValueError; every config problem is a ConfigError)
        raise ConfigError(f"unknown phase {phase!r}; known: {[x.value for x in Phase]}") from None
    if p is Phase.REF_LOG_PROB:
        return PhasePlan(Action.NATIVE, None)
    return _PLANS[(m, p)]


@dataclass
class ReplayConfig:
    """The ``r3bridge`` section of a job config. ``configs/r3bridge.yaml`` mirrors these defaults
    (a test keeps the two equal) for omegaconf / hydra users.

    Also an OmegaConf structured config, at the top level or nested in a framework's config
    (AReaL's ``GRPOConfig``, SkyRL's ``TrainerConfig``). Not ``frozen``: OmegaConf makes a frozen
    dataclass's nodes read-only, and a nested section could then not be filled from YAML. Treat an
    instance as read-only; validation runs when it is built (``__post_init__``)."""

    # Annotated ``str`` (a ReplayMode is one) so that ``OmegaConf.structured(ReplayConfig)`` takes
    # ``off`` / ``disabled`` / YAML's ``false``; ``__post_init__`` turns it into a ReplayMode.
    replay_mode: str = ReplayMode.OFF
    # Compute, inside the router hook, whether the native top-k equals the replayed one
    # (per-layer route agreement). Costs one extra top-k per router call, no extra forward.
    agreement: bool = True
    # Fail when fewer than this fraction of routed rows have a real route (0 disables).
    min_coverage: float = 0.0
    # Rows without a route (invalid): "native" routes them with the router's own top-k (counted
    # in metrics); "error" refuses any invalid row inside a sequence's covered range.
    invalid_rows: str = "native"
    metrics_prefix: str = "r3bridge/"
    # Log agreement/layer_<id> for every MoE layer (False: agreement/mean, agreement/min and the
    # WORST_LAYERS least-agreeing layers only; megatron-core also keeps per-layer MoE logging opt-in).
    per_layer_metrics: bool = False
    # Route traces for `r3bridge inspect` / `diff` (r3bridge/megatron/trace.py; off when None):
    # every `trace_every`-th RL step, each rank writes what its routers replayed and would have
    # chosen natively, until it has written its share of `trace_max_bytes` (then it stops and
    # says so in its index and in the `trace/stopped` metric).
    trace_dir: Optional[str] = None
    trace_every: int = 1
    trace_max_bytes: int = 1 << 30
    # What the layer axis of the rollout routes is (r3bridge/layer_axis.py): "all_hidden" (vLLM,
    # SGLang: every decoder layer), "moe_only" (TensorRT-LLM: MoE layers only), or null: read
    # from its length only where that is unambiguous, refused otherwise (never guessed).
    layer_axis: Optional[str] = None
    # Routes whose provenance (engine pass: request id, weight version, re-prefill epoch) differs
    # from that of the log-probs they are paired with (r3bridge/provenance.py; miles #3277, vLLM
    # #39917): "count" replays them and counts them (provenance/* metrics), "refuse" raises a
    # ProvenanceError naming the sample and both provenances before the pass installs anything,
    # "off" compares nothing.
    provenance_check: str = "count"
    # What replay does with a replayed expert (r3bridge/replay_policy.py): "hard" dispatches
    # every one; "threshold" keeps one only if the trainer's own score for it is at least
    # threshold_ratio x the weakest score of the trainer's native top-k, else the native choice
    # replaces it (prime-rl #2703), and reports the replaced fraction.
    replay_policy: str = "hard"
    threshold_ratio: float = 0.5
    # Hand the framework's loss the per-token router log-ratio (trainer vs rollout gate weights
    # of the replayed experts; r3bridge/replay_policy.py) for router importance sampling
    # (prime-rl #1406 / #1661, RSPO). Needs routing weights in the routes and pp == 1; the
    # router_log_ratio metrics are reported whenever the routes carry weights.
    router_log_ratio: bool = False
    # The rollout engine's release (e.g. "0.26.0"), for settings only some releases get right
    # (r3bridge/engine_settings.py: R3 with speculative decoding needs vLLM >= 0.26.0 / SGLang
    # >= 0.5.15). null: read the engine's distribution installed in the trainer's environment;
    # set it when the engine runs elsewhere (when neither tells, such settings are refused).
    engine_version: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "replay_mode", ReplayMode.parse(self.replay_mode))
        if not 0.0 <= float(self.min_coverage) <= 1.0:
            raise ConfigError(f"min_coverage must be in [0, 1], got {self.min_coverage}")
        if self.invalid_rows not in ("native", "error"):
            raise ConfigError(f"invalid_rows must be 'native' or 'error', got {self.invalid_rows!r}")
        check_layer_axis(self.layer_axis, where="r3bridge.layer_axis")
        if self.provenance_check not in CHECK_MODES:
            raise ConfigError(f"provenance_check must be one of {', '.join(CHECK_MODES)}, got {self.provenance_check!r}")
        self._check_trace()
        check_policy(self.replay_policy, self.threshold_ratio)
        if not isinstance(self.router_log_ratio, bool):
            raise ConfigError(f"router_log_ratio must be true or false, got {self.router_log_ratio!r}")
        check_engine_version_setting(self.engine_version)

    def _check_trace(self) -> None:
        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir.strip()):
            raise ConfigError(f"trace_dir must be a folder path or null, got {self.trace_dir!r}")
        for name in ("trace_every", "trace_max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> "ReplayConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown r3bridge option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ReplayConfig":
        """``R3BRIDGE_CONFIG`` (JSON of the section) or ``R3BRIDGE_REPLAY_MODE``, else defaults.

        How the section reaches framework workers that never see the job config (verl and SkyRL
        Ray workers inherit it through ``runtime_env``)."""
        env = os.environ if environ is None else environ
        raw = env.get(ENV_CONFIG)
        if raw:
            try:
                d = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{ENV_CONFIG} is not valid JSON ({e}): {raw!r}") from None
            if not isinstance(d, dict):
                raise ConfigError(f"{ENV_CONFIG} must be a JSON object, got {raw!r}")
            if env.get(ENV_MODE) and ReplayMode.parse(env[ENV_MODE]) != ReplayMode.parse(d.get("replay_mode", "off")):
                raise ConfigError(f"{ENV_CONFIG} and {ENV_MODE} disagree on replay_mode")
            return cls.from_mapping(d)
        if env.get(ENV_MODE):
            return cls(replay_mode=ReplayMode.parse(env[ENV_MODE]))
        return cls()

    @classmethod
    def resolve_with_source(cls, cfg: "ReplayConfig | Mapping[str, Any] | None" = None
                            ) -> "tuple[ReplayConfig, str]":
        """:meth:`resolve` plus where the section came from: ``"config"`` (passed explicitly),
        ``"environment (R3BRIDGE_CONFIG)"``, ``"environment (R3BRIDGE_REPLAY_MODE)"`` or ``"default"``."""
        if cfg is not None:
            return cls.resolve(cfg), SOURCE_CONFIG
        source = (f"environment ({ENV_CONFIG})" if os.environ.get(ENV_CONFIG)
                  else f"environment ({ENV_MODE})" if os.environ.get(ENV_MODE) else SOURCE_DEFAULT)
        return cls.from_env(), source

    @classmethod
    def resolve(cls, cfg: "ReplayConfig | Mapping[str, Any] | None" = None) -> "ReplayConfig":
        """An explicit config (object or mapping), else :meth:`from_env`."""
        if isinstance(cfg, cls):
            return cfg
        if cfg is not None:
            return cls.from_mapping(cfg)
        return cls.from_env()

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["replay_mode"] = self.replay_mode.value
        return out

    def plan(self, phase: Phase | str) -> PhasePlan:
        return phase_plan(self.replay_mode, phase)
