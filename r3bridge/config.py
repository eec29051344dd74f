"""`replay_mode` and what it means in each trainer phase: the one place R2/R3 semantics live.

Every adapter asks :func:`phase_plan` what to do in ``compute_log_prob``, the update passes and
the reference-model pass, so the frameworks cannot drift apart (a peer replayed rollout routes
under R2: field notes 8.8).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, Iterable, Mapping, Optional

from r3bridge.batch.provenance import CHECK_MODES
from r3bridge.engines.engine_settings import check_engine_version_setting
from r3bridge.engines.layer_axis import check_layer_axis
from r3bridge.errors import ConfigError
from r3bridge.replay_policy import check_policy

ENV_CONFIG = "R3BRIDGE_CONFIG"         # JSON of the r3bridge section (all of it, or some keys)
ENV_MODE = "R3BRIDGE_REPLAY_MODE"      # shortcut: only replay_mode
# Set next to R3BRIDGE_CONFIG by a launcher that forwards the section it resolved to its workers
# (value: the launcher's name). Such an R3BRIDGE_CONFIG is r3bridge's own transport, already merged
# from the job's section and the user's environment: a worker reads it, a later resolution in the
# launcher's own process does not merge it a second time.
ENV_FROM = "R3BRIDGE_CONFIG_FROM"
# Every R3BRIDGE_* variable r3bridge reads, and what it is: any other is a typo, refused at launch
# (check_environment), never ignored.
ENV_SETTINGS = {
    ENV_CONFIG: "JSON of the r3bridge section (any options)",
    ENV_MODE: "the replay mode alone: R2, R3 or off",
    ENV_FROM: "set by a launcher next to the R3BRIDGE_CONFIG it forwards to its workers",
    "R3BRIDGE_WATCH": "set by a launcher: the stall watchdog's job id its workers report under",
    "R3BRIDGE_ROUTES_RUN": "set by a launcher: the run id its rollout and trainer workers store and read "
                           "routes by reference under (route_transport: handles)",
    "R3BRIDGE_LOGGING_LEVEL": "the level of r3bridge's own logger (default INFO)",
    "R3BRIDGE_CONFORMANCE_FAULT": "scripts/gpu/nccl_conformance.py: a fault injected into one rank",
    "R3BRIDGE_VERL_ROOT": "benchmarks: a framework source tree to import from",
    "R3BRIDGE_SKYRL04": "tests: where a framework release's wheel is unpacked",
}
ORIGIN_CONFIG = "config"      # config origins: where the r3bridge section came from
ORIGIN_DEFAULT = "default"

__all__ = ["ReplayMode", "Phase", "Action", "PhasePlan", "ReplayConfig", "phase_plan", "forward_env", "ENV_SETTINGS",
           "check_environment", "REPLAY_WEIGHTS", "check_replay_weights"]


class ReplayMode(str, Enum):
    OFF = "off"
    R2 = "R2"   # record the trainer's own routes in compute_log_prob, replay them in the updates
    R3 = "R3"   # replay the rollout engine's routes in every trainer forward

    def __str__(self) -> str:    # "off", not "ReplayMode.OFF" (OmegaConf and f-strings use str())
        return self.value

    @classmethod
    def parse(cls, value: Any) -> "ReplayMode":
        """``off`` / ``R2`` / ``R3`` in any case. ``disabled`` (a framework's spelling of off) and ``false``
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
    route_kind: str | None   # which routes a replay pass replays: "rollout" (R3) or "recorded" (R2)
    # routing-weights replay (ReplayConfig.replay_weights; docs/architecture.md, "Routing weights"):
    # the pass sets each replayed (token, k)'s combine weight to the routes' weight, router frozen
    replay_weights: bool = False
    # the pass records the ids its routers used and their final combine weights (a recorded
    # ReplayBatch with weights, for the updates to replay): R2's recording, or R3w's compute_log_prob
    record_weights: bool = False

    @property
    def records(self) -> bool:
        """Whether the pass hands back recorded routes (R2's recording, or R3w's)."""
        return self.action is Action.RECORD or self.record_weights


_PLANS: dict[tuple[ReplayMode, Phase], PhasePlan] = {
    (ReplayMode.OFF, Phase.OLD_LOG_PROB): PhasePlan(Action.NATIVE, None),
    (ReplayMode.OFF, Phase.UPDATE): PhasePlan(Action.NATIVE, None),
    (ReplayMode.R2, Phase.OLD_LOG_PROB): PhasePlan(Action.RECORD, None),
    (ReplayMode.R2, Phase.UPDATE): PhasePlan(Action.REPLAY, "recorded"),
    (ReplayMode.R3, Phase.OLD_LOG_PROB): PhasePlan(Action.REPLAY, "rollout"),
    (ReplayMode.R3, Phase.UPDATE): PhasePlan(Action.REPLAY, "rollout"),
}


# r3bridge.replay_weights: where the combine weights a replayed token gets come from
REPLAY_WEIGHTS = ("off", "recorded", "rollout")


def check_replay_weights(mode: ReplayMode | str, replay_weights: Any, *, resolved: bool = True) -> str:
    """``replay_weights`` checked against ``mode``; returns it. ``recorded``: compute_log_prob
    records the combine weights of the ids it routed with (R2: its own; R3: the engine's) and every
    update replays ids and weights; ``rollout`` (R3 only): every pass replays the weights handed
    with the rollout routes (an engine's, e.g. SGLang's ``--enable-return-routed-expert-weights``).

    ``resolved=False`` (a section that may still be merged with the environment's
    ``replay_mode``: :meth:`ReplayConfig.resolve_with_origin`) leaves out the check that replay
    is on; the adapter session and :func:`phase_plan` make it on the options in force."""
    m = ReplayMode.parse(mode)
    if replay_weights is False or replay_weights is None:
        replay_weights = "off"
    if not isinstance(replay_weights, str) or replay_weights not in REPLAY_WEIGHTS:
        raise ConfigError(f"replay_weights must be one of {', '.join(REPLAY_WEIGHTS)} (false also means off), "
                          f"got {replay_weights!r}")
    if replay_weights != "off" and m is ReplayMode.OFF and resolved:
        raise ConfigError(f"replay_weights={replay_weights} needs replay_mode R2 or R3 (replay_mode is off: "
                          f"nothing is replayed, so no weight would be)")
    if replay_weights == "rollout" and m is ReplayMode.R2:
        raise ConfigError("replay_weights=rollout replays the weights handed with the rollout routes, which "
                          "R2 does not replay; R2 takes replay_weights=recorded (compute_log_prob records them)")
    return replay_weights


def phase_plan(mode: ReplayMode | str, phase: Phase | str, replay_weights: str = "off") -> PhasePlan:
    """What the driver does in ``phase`` under ``mode`` (and ``replay_weights``, see
    :func:`check_replay_weights`). The reference model never replays.

    ``replay_weights="recorded"`` under R3 ("R3w"): compute_log_prob replays the engine's ids and
    records the combine weights they got; the updates replay the recorded ids (the engine's, the
    native ones on rows without a route) with those weights, so their route kind is "recorded"."""
    m = ReplayMode.parse(mode)
    w = check_replay_weights(m, replay_weights)
    try:
        p = Phase(phase)
    except ValueError:   # (was a bare ValueError; every config problem is a ConfigError)
        raise ConfigError(f"unknown phase {phase!r}; known: {[x.value for x in Phase]}") from None
    if p is Phase.REF_LOG_PROB:
        return PhasePlan(Action.NATIVE, None)
    plan = _PLANS[(m, p)]
    if w == "rollout":
        return PhasePlan(plan.action, plan.route_kind, replay_weights=True)
    if w == "recorded":
        if p is Phase.OLD_LOG_PROB:
            return PhasePlan(plan.action, plan.route_kind, record_weights=True)
        return PhasePlan(Action.REPLAY, "recorded", replay_weights=True)
    return plan


# r3bridge.route_transport: the route bytes in the batch, or a handle per sample (r3bridge/handles/)
ROUTE_TRANSPORTS = ("inline", "handles")
DEFAULT_ROUTE_STORE = "/dev/shm/r3bridge-routes"      # r3bridge.route_store: route files in shared memory


@dataclass
class ReplayConfig:
    """The ``r3bridge`` section of a job config. ``configs/r3bridge.yaml`` mirrors these defaults
    (a test keeps the two equal) for omegaconf / hydra users.

    Also an OmegaConf structured config, at the top level or nested in a framework's config
    (a framework's job config dataclass). Not ``frozen``: OmegaConf makes a frozen
    dataclass's nodes read-only, and a nested section could then not be filled from YAML. Treat an
    instance as read-only; validation runs when it is built (``__post_init__``)."""

    # Annotated ``str`` (a ReplayMode is one) so that ``OmegaConf.structured(ReplayConfig)`` takes
    # ``off`` / ``disabled`` / YAML's ``false``; ``__post_init__`` turns it into a ReplayMode.
    replay_mode: str = ReplayMode.OFF
    # Compute, inside the router hook, whether the native top-k equals the replayed one
    # (per-layer route agreement). Costs one extra top-k per router call, no extra forward.
    agreement: bool = True
    # Fail when fewer than this fraction of routed rows have a real route (0 disables): per
    # micro-batch, over each rank's real tokens.
    min_coverage: float = 0.0
    # R3: fail a pass whose rollout routes cover less than this fraction of its routed (token,
    # MoE layer) pairs, every rank and layer summed (0 disables). The default catches an engine
    # that returned no usable routes (vLLM #54730: all-zero rows that zero-row transports read as
    # "no route") instead of training on native routing in silence.
    coverage_floor: float = 0.1
    # Inside the rows an engine returned for a sample, a row whose expert ids repeat is a
    # degenerate route (a broken capture, vLLM #54730), never "no route": "refuse" fails the step
    # naming sample, row and layer; "native" routes such rows natively and counts them
    # (degenerate_pairs, samples/refused metrics).
    degenerate_routes: str = "refuse"
    # Rows without a route (invalid): "native" routes them with the router's own top-k (counted
    # in metrics); "error" refuses any invalid row inside a sequence's covered range.
    invalid_rows: str = "native"
    metrics_prefix: str = "r3bridge/"
    # Log agreement/layer_<id> for every MoE layer (False: agreement/mean, agreement/min and the
    # WORST_LAYERS least-agreeing layers only; megatron-core also keeps per-layer MoE logging opt-in).
    per_layer_metrics: bool = False
    # Route traces for `r3bridge inspect` / `diff` (r3bridge/trace/writing.py; off when None):
    # every `trace_every`-th RL step, each rank writes what its routers replayed and would have
    # chosen natively, until it has written its share of `trace_max_bytes` (then it stops and
    # says so in its index and in the `trace/stopped` metric).
    trace_dir: Optional[str] = None
    trace_every: int = 1
    trace_max_bytes: int = 1 << 30
    # What the layer axis of the rollout routes is (r3bridge/engines/layer_axis.py): "all_hidden" (vLLM,
    # SGLang: every decoder layer), "moe_only" (TensorRT-LLM: MoE layers only), or null: read
    # from its length only where that is unambiguous, refused otherwise (never guessed).
    layer_axis: Optional[str] = None
    # Routes whose provenance (engine pass: request id, weight version, re-prefill epoch) differs
    # from that of the log-probs they are paired with (r3bridge/batch/provenance.py; miles #3277, vLLM
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
    # A launcher that waits on stages it cannot see (workers starting with r3bridge's engine, the
    # first replayed pass) says which one is stuck and what it waits for after this many seconds
    # without progress, and again every as many; 0 turns it off. 180 s: within a CPU rehearsal's
    # patience, above a clean stage on a loaded 2-core machine (worker start: 124 s seen). A stage
    # whose actors cannot be placed at all is said sooner (the launcher's own bound, 20 s).
    stall_warning_s: float = 180.0
    # The rollout engine's release (e.g. "0.26.0"), for settings only some releases get right
    # (r3bridge/engines/engine_settings.py: R3 with speculative decoding needs vLLM >= 0.26.0 / SGLang
    # >= 0.5.15). null: read the engine's distribution installed in the trainer's environment;
    # set it when the engine runs elsewhere (when neither tells, such settings are refused).
    engine_version: Optional[str] = None
    # How rollout routes reach the trainer's ranks (docs/route-handles.md): "inline" (the route bytes
    # in the framework's batch field, as each framework moves them) or "handles" (each sample's
    # routes written once to a store, the field carries a small r3bridge.handles.RouteHandle, and
    # each rank reads only its rows of its stage's layers).
    route_transport: str = "inline"
    # Routing-weights replay (docs/architecture.md, "Routing weights"): "off" replays expert ids
    # only (the combine weights are the live router's); "recorded": compute_log_prob records the
    # final combine weights of the ids it routed with (R3: the engine's ids, "R3w"; R2: its own)
    # and every update replays ids and weights, the router frozen for those tokens (prime-rl #3523);
    # "rollout" (R3): every pass replays the weights handed with the rollout routes (an engine's).
    replay_weights: str = "off"
    # Where route_transport: handles stores the routes: a folder (one file per sample, read with pread,
    # under <folder>/<run id>/<RL step>/; the default is shared memory on one node, a shared file
    # system's folder serves several nodes) or "ray" (Ray's object store, where an adapter supports it).
    route_store: str = DEFAULT_ROUTE_STORE

    def __post_init__(self) -> None:
        object.__setattr__(self, "replay_mode", ReplayMode.parse(self.replay_mode))
        if not 0.0 <= float(self.min_coverage) <= 1.0:
            raise ConfigError(f"min_coverage must be in [0, 1], got {self.min_coverage}")
        if not 0.0 <= float(self.coverage_floor) <= 1.0:
            raise ConfigError(f"coverage_floor must be in [0, 1], got {self.coverage_floor}")
        if self.degenerate_routes not in ("refuse", "native"):
            raise ConfigError(f"degenerate_routes must be 'refuse' or 'native', got {self.degenerate_routes!r}")
        if self.invalid_rows not in ("native", "error"):
            raise ConfigError(f"invalid_rows must be 'native' or 'error', got {self.invalid_rows!r}")
        check_layer_axis(self.layer_axis, where="r3bridge.layer_axis")
        if self.provenance_check not in CHECK_MODES:
            raise ConfigError(f"provenance_check must be one of {', '.join(CHECK_MODES)}, got {self.provenance_check!r}")
        self._check_trace()
        check_policy(self.replay_policy, self.threshold_ratio)
        if not isinstance(self.router_log_ratio, bool):
            raise ConfigError(f"router_log_ratio must be true or false, got {self.router_log_ratio!r}")
        if isinstance(self.stall_warning_s, bool) or not isinstance(self.stall_warning_s, (int, float)) \
                or self.stall_warning_s < 0:
            raise ConfigError(f"stall_warning_s must be a number of seconds >= 0 (0: off), got {self.stall_warning_s!r}")
        check_engine_version_setting(self.engine_version)
        # (that replay is on is checked on the options in force, after the environment's merge)
        object.__setattr__(self, "replay_weights",
                           check_replay_weights(self.replay_mode, self.replay_weights, resolved=False))
        if self.route_transport not in ROUTE_TRANSPORTS:
            raise ConfigError(f"route_transport must be one of {', '.join(ROUTE_TRANSPORTS)}, got {self.route_transport!r}")
        if not isinstance(self.route_store, str) or not self.route_store.strip():
            raise ConfigError(f"route_store must be a folder path or 'ray', got {self.route_store!r}")
        if self.route_store != "ray":        # a folder: absolute where the launcher resolves it (as trace_dir)
            object.__setattr__(self, "route_store", os.path.abspath(os.path.expanduser(self.route_store)))

    def _check_trace(self) -> None:
        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir.strip()):
            raise ConfigError(f"trace_dir must be a folder path or null, got {self.trace_dir!r}")
        if self.trace_dir is not None:
            # absolute in the process that reads the job's setting (the launcher): a worker started
            # in another folder (a Ray worker, a framework's launcher) writes where the user pointed; "~" too, which
            # no shell expands inside `r3bridge.trace_dir=~/x`
            object.__setattr__(self, "trace_dir", os.path.abspath(os.path.expanduser(self.trace_dir)))
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
        """``R3BRIDGE_CONFIG`` (JSON of the section) and / or ``R3BRIDGE_REPLAY_MODE``, else defaults.

        How the section reaches framework workers that never see the job config (Ray workers
        inherit it through ``runtime_env``)."""
        keys, _ = _env_section(os.environ if environ is None else environ)
        return cls.from_mapping(keys)

    @classmethod
    def resolve_with_origin(cls, cfg: "ReplayConfig | Mapping[str, Any] | None" = None,
                            environ: Mapping[str, str] | None = None, *,
                            section_name: str = "the job's r3bridge section",
                            set_keys: "Iterable[str] | None" = None) -> "tuple[ReplayConfig, str]":
        """The options in force and where they came from (the config origin): the job's section ``cfg`` (a
        ``ReplayConfig`` or a mapping of the keys the job sets) merged with the environment
        (``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``). Every adapter's launcher and worker
        resolves through here, so the environment setting is never dropped:

        * only one of them: that one (``"config"``, ``"environment (R3BRIDGE_CONFIG)"``, ...);
        * both: the environment fills the keys the section does not set (origin
          ``"config + environment (R3BRIDGE_CONFIG): trace_dir"``); a key both set to different
          values is refused (:class:`ConfigError` naming the key, both values and both places);
        * neither: the defaults (``"default"``).

        A key counts as set by the section when the mapping has it; for a ``ReplayConfig`` (a
        framework's typed section, where an unset key holds its default) when it is in
        ``set_keys`` (the keys the command line or YAML named, where the adapter knows them), else
        when it differs from the default. An ``R3BRIDGE_CONFIG`` that a launcher forwarded (``R3BRIDGE_CONFIG_FROM``
        set, :func:`forward_env`) is that launcher's resolution: read where there is no section,
        not merged again where there is one."""
        env = os.environ if environ is None else environ
        env_keys, env_origin = _env_section(env)
        if cfg is None:
            if env_keys is None:
                return cls(), ORIGIN_DEFAULT
            return cls.from_mapping(env_keys), env_origin
        section = cfg if isinstance(cfg, cls) else cls.from_mapping(cfg)
        if env_keys is None or env.get(ENV_FROM):
            return section, ORIGIN_CONFIG
        default = cls().as_dict()
        have = section.as_dict()
        if not isinstance(cfg, cls):
            set_here = set(cfg)
        elif set_keys is not None:
            set_here = set(set_keys)
        else:
            set_here = {k for k, v in have.items() if v != default[k]}
        theirs = cls.from_mapping(env_keys).as_dict()
        clash = [k for k in env_keys if k in set_here and theirs[k] != have[k]]
        if clash:
            raise ConfigError("r3bridge option(s) set twice with different values: " + "; ".join(
                f"{k}={have[k]!r} in {section_name} and {k}={theirs[k]!r} in {env_origin.split('(', 1)[1].rstrip(')')}"
                for k in clash) + ". Set each option in one place (or the same value in both)")
        added = [k for k in env_keys if k not in set_here]
        if not added:
            return section, ORIGIN_CONFIG
        return cls.from_mapping({**have, **{k: theirs[k] for k in added}}), f"{ORIGIN_CONFIG} + {env_origin}: {', '.join(added)}"

    @classmethod
    def resolve(cls, cfg: "ReplayConfig | Mapping[str, Any] | None" = None) -> "ReplayConfig":
        """:meth:`resolve_with_origin` without the origin."""
        return cls.resolve_with_origin(cfg)[0]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["replay_mode"] = self.replay_mode.value
        return out

    def plan(self, phase: Phase | str) -> PhasePlan:
        return phase_plan(self.replay_mode, phase, self.replay_weights)


def _env_section(env: Mapping[str, str]) -> tuple[Optional[dict[str, Any]], str]:
    """The keys the environment sets (``None``: none) and the origin's name."""
    raw, mode = env.get(ENV_CONFIG), env.get(ENV_MODE)
    keys: Optional[dict[str, Any]] = None
    if raw:
        try:
            keys = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_CONFIG} is not valid JSON ({e}): {raw!r}") from None
        if not isinstance(keys, dict):
            raise ConfigError(f"{ENV_CONFIG} must be a JSON object, got {raw!r}")
    if mode:
        if keys is not None and "replay_mode" in keys and ReplayMode.parse(mode) != ReplayMode.parse(keys["replay_mode"]):
            raise ConfigError(f"{ENV_CONFIG} and {ENV_MODE} disagree on replay_mode")
        keys = {**(keys or {}), "replay_mode": mode}
    if raw:
        by = env.get(ENV_FROM)
        return keys, f"environment ({ENV_CONFIG}{f' from the {by}' if by else ''})"
    return keys, f"environment ({ENV_MODE})"


def forward_env(cfg: ReplayConfig, where: str) -> dict[str, str]:
    """The environment variables a launcher hands its workers (and sets in its own process): the
    resolved section as ``R3BRIDGE_CONFIG`` and ``R3BRIDGE_CONFIG_FROM=where``."""
    return {ENV_CONFIG: json.dumps(cfg.as_dict()), ENV_FROM: where}


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse, before anything starts, an environment whose r3bridge settings cannot be what the
    user meant: an ``R3BRIDGE_*`` name r3bridge does not read (a typo would otherwise leave replay
    off) or a value of ``R3BRIDGE_REPLAY_MODE`` / ``R3BRIDGE_CONFIG`` that does not parse. One
    :class:`ConfigError` naming each variable and what it takes."""
    env = os.environ if environ is None else environ
    problems = [f"{name} is not an r3bridge setting (r3bridge reads {', '.join(sorted(ENV_SETTINGS))})"
                for name in sorted(env) if name.startswith("R3BRIDGE_") and name not in ENV_SETTINGS]
    for name in (ENV_MODE, ENV_CONFIG):
        if env.get(name):
            try:
                ReplayConfig.from_env({name: env[name]})
            except ConfigError as e:
                problems.append(f"{name}={env[name]!r}: {e}" if name == ENV_MODE else f"{name}: {e}")
    if not problems:
        try:
            ReplayConfig.from_env(env)          # the two together (they may disagree)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("environment: " + "; ".join(problems))
