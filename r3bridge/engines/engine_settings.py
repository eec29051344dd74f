"""Rollout-engine settings that make R3's routes wrong while every shape stays valid, refused when
the job is configured (an adapter's config check calls :func:`check_speculative_decoding`).

Speculative decoding: the draft model (MTP / EAGLE / NextN) runs MoE layers of its own, numbered
from 0 like the target's, and writes into the same routed-experts capture; before the fixes its
layer 0 overwrote the target's layer-0 routes. The routes keep their shape and ids stay in range,
so nothing downstream can see it: R3 replays the draft's choices on layer 0.

* vLLM: fixed in 0.26.0 (vLLM #48622: the capturer binds the target model's modules only; 0.25.1
  still has the bug, field notes section 15);
* SGLang: fixed in 0.5.15 (SGLang #26980: ``ModelRunner`` turns capture off for every draft
  worker, ``disable_routed_experts_capture_for_draft``; 0.5.14 lacks it, read from both wheels).

Which release the engine runs: the explicit setting ``r3bridge.engine_version`` when given (the
engine may run in another environment, e.g. servers the trainer only talks to), else the
distribution installed in the trainer's environment (``importlib.metadata``: nothing is imported).
When neither says, the version is unknown, and speculative decoding under R3 is refused with a
message asking for ``engine_version`` (or speculative decoding off): never assumed fixed.

Prefill / decode disaggregation and KV connectors (:func:`check_kv_transfer`): the decode node
receives the prompt's KV cache and never runs the prompt forward, so the prompt's route rows are
whatever the capture buffer held (llm-d-router #1473; no error, every shape valid). vLLM's newest
releases refuse routed experts with a KV connector; older ones and SGLang's
``disaggregation_mode`` do not. Under R3 any such setting is refused: R3 would replay garbage on
exactly the prompt rows.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Mapping, Optional

from packaging.version import InvalidVersion, Version

from r3bridge.errors import ConfigError

__all__ = ["SPECULATIVE_FIXED_IN", "EngineRelease", "engine_release", "check_engine_version_setting",
           "speculative_decoding_problem", "check_speculative_decoding", "KV_TRANSFER_SETTINGS",
           "kv_transfer_problem", "check_kv_transfer"]

# engine settings that serve a request through prefill / decode disaggregation or a KV connector,
# and the values that mean "off"
KV_TRANSFER_SETTINGS: dict[str, tuple[str, ...]] = {
    "kv_transfer_config": (),                     # vLLM: {"kv_connector": ..., "kv_role": ...}
    "kv_connector": (),                           # vLLM's KVTransferConfig field, flattened by a framework
    "disaggregation_mode": ("null", "none"),     # SGLang: "prefill" / "decode"
    "disaggregation_transfer_backend": (),        # SGLang: set only with disaggregation
}

# engine -> (first release whose routes a speculative draft no longer corrupts, the fix)
SPECULATIVE_FIXED_IN: dict[str, tuple[str, str]] = {
    "vllm": ("0.26.0", "vLLM #48622"),
    "sglang": ("0.5.15", "SGLang #26980"),
}
_SETTING = "r3bridge.engine_version"


@dataclass(frozen=True)
class EngineRelease:
    """The rollout engine's release as far as the trainer can tell: ``version`` ``None`` when
    unknown; ``read_from`` says where it was read."""

    engine: str
    version: Optional[Version]
    read_from: str

    def __str__(self) -> str:
        name = {"vllm": "vLLM", "sglang": "SGLang"}.get(self.engine, self.engine)
        return f"{name} {self.version} ({self.read_from})" if self.version is not None else f"{name} (version unknown)"


def check_engine_version_setting(value: Optional[str]) -> Optional[str]:
    """``r3bridge.engine_version``: ``None`` or a release number (``"0.26.0"``)."""
    if value is None:
        return None
    try:
        Version(str(value))
    except InvalidVersion:
        raise ConfigError(f"{_SETTING} must be the rollout engine's release, e.g. '0.26.0', got {value!r}") from None
    return str(value)


def engine_release(engine: str, configured: Optional[str] = None) -> EngineRelease:
    """The release of ``engine`` (``"vllm"`` / ``"sglang"``): ``configured`` (the
    ``engine_version`` setting) first, else the distribution installed in this environment."""
    if configured is not None:
        return EngineRelease(engine, Version(check_engine_version_setting(configured)), _SETTING)
    try:
        installed = importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return EngineRelease(engine, None, "")
    try:
        return EngineRelease(engine, Version(installed), "installed in the trainer's environment")
    except InvalidVersion:
        return EngineRelease(engine, None, "")


def speculative_decoding_problem(mode: str, engine: Optional[str], speculative: Mapping[str, object], *,
                                 configured_version: Optional[str] = None) -> Optional[str]:
    """Why R3 cannot run with these speculative-decoding settings (``None``: it can): the engine
    release's draft overwrites the target's layer-0 routes, or the release is unknown.
    ``speculative``: the framework settings that turn speculative decoding on, ``{setting:
    value}``, only those that do (empty: off); ``engine``: the rollout engine (another engine
    than vLLM / SGLang: nothing known, nothing checked)."""
    if str(mode) != "R3" or not speculative or engine not in SPECULATIVE_FIXED_IN:
        return None
    fixed, issue = SPECULATIVE_FIXED_IN[engine]
    release = engine_release(engine, configured_version)
    settings = ", ".join(f"{k}={v!r}" for k, v in speculative.items())
    name = str(release).split(" ")[0]
    if release.version is None:
        return (f"r3bridge.replay_mode=R3 with speculative decoding ({settings}): {name} is not installed in the "
                f"trainer's environment and {_SETTING} is not set, so whether the rollout engine has the fix for its "
                f"draft model overwriting the target's layer-0 routes ({issue}, {name} >= {fixed}) cannot be told: "
                f"set {_SETTING} to the engine's release, or turn speculative decoding off")
    if release.version < Version(fixed):
        return (f"r3bridge.replay_mode=R3 with speculative decoding ({settings}) on {release}: before {name} {fixed} "
                f"the draft model's layer 0 overwrites the target's layer-0 routes ({issue}; shapes stay valid, so R3 "
                f"would replay the draft's choices): upgrade {name} to >= {fixed} or turn speculative decoding off")
    return None


def check_speculative_decoding(mode: str, engine: Optional[str], speculative: Mapping[str, object], *,
                               configured_version: Optional[str] = None) -> None:
    """:func:`speculative_decoding_problem` as a ``ConfigError``."""
    problem = speculative_decoding_problem(mode, engine, speculative, configured_version=configured_version)
    if problem is not None:
        raise ConfigError(problem)


def _kv_on(key: str, value: object) -> bool:
    if value is None or value is False or value == "" or value == {} or value == []:
        return False
    off = KV_TRANSFER_SETTINGS.get(key, ())
    return not (isinstance(value, str) and value.strip().lower() in off)


def kv_transfer_problem(mode: str, engine: Optional[str], settings: Mapping[str, object]) -> Optional[str]:
    """Why R3 cannot run with these rollout-engine settings (``None``: it can): a KV connector or
    prefill / decode disaggregation serves the prompt's KV cache from another node, so the prompt's
    route rows were never computed where they are returned. ``settings``: the engine settings the
    framework shows (any of :data:`KV_TRANSFER_SETTINGS`; others are ignored)."""
    if str(mode) != "R3":
        return None
    on = {k: v for k, v in settings.items() if k in KV_TRANSFER_SETTINGS and _kv_on(k, v)}
    if not on:
        return None
    name = {"vllm": "vLLM", "sglang": "SGLang"}.get(str(engine), str(engine))
    found = ", ".join(f"{k}={v!r}" for k, v in on.items())
    return (f"r3bridge.replay_mode=R3 with the rollout served through a KV connector / prefill-decode "
            f"disaggregation ({name}: {found}): the decode node never runs the prompt forward, so the prompt's "
            f"route rows are whatever its capture buffer held (llm-d-router #1473: no error, valid shapes) and R3 "
            f"would replay them; serve R3 rollouts without KV transfer, or use R2")


def check_kv_transfer(mode: str, engine: Optional[str], settings: Mapping[str, object]) -> None:
    """:func:`kv_transfer_problem` as a ``ConfigError``."""
    problem = kv_transfer_problem(mode, engine, settings)
    if problem is not None:
        raise ConfigError(problem)
