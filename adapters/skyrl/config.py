"""The ``r3bridge`` section on SkyRL's own command line (``trainer.r3bridge.replay_mode=R3``), and the
job's settings checked. docs/use-with-skyrl.md, "Configuration"."""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Optional, Sequence

from r3bridge.adapters.skyrl._compat import import_skyrl
from r3bridge.announce import announce
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.engines.engine_settings import kv_transfer_problem, speculative_decoding_problem
from r3bridge.errors import ConfigError, RoleError
from r3bridge.job_check import JobCheck, environment_setting, section_key_problem, setting, with_replay_section
from r3bridge.launch.preflight import section_keys

__all__ = ["skyrl_config_class", "parse_cli", "replay_config_from_skyrl", "prepare_skyrl_config",
           "speculative_settings", "command_line_section", "SECTION"]

SECTION = "trainer.r3bridge"
_ENTRYPOINT = "trainer.override_entrypoint="


@functools.lru_cache(maxsize=None)
def skyrl_config_class() -> type:
    """``SkyRLTrainConfig`` whose ``trainer`` has an ``r3bridge: ReplayConfig`` field (``make_config``)."""
    sk = import_skyrl("skyrl.train.config.config")
    # SkyRLTrainConfig.__post_init__ imports this module; on Python 3.11 only through import_skyrl
    import_skyrl("skyrl.backends.skyrl_train.inference_servers.utils")
    return sk.make_config(trainer_cls=with_replay_section(sk.TrainerConfig, "R3BridgeTrainerConfig", __name__))


def command_line_section(argv: Sequence[str]) -> tuple[ReplayConfig, str]:
    """The section a SkyRL command line sets (``trainer.r3bridge.<key>=<value>``, values read as YAML
    scalars, as hydra reads them) merged with the environment, read without SkyRL: what the launcher
    refuses (the variable named for a bad environment value, every valid key for a mistyped one) and
    announces before it imports SkyRL. SkyRL's parser reads the same keys again into its config."""
    import yaml

    environment_setting()                        # a bad R3BRIDGE_* value: ConfigError naming the variable
    prefix = f"{SECTION}."
    keys: dict[str, Any] = {}
    for arg in argv:
        name, eq, value = arg.lstrip("+").partition("=")
        if not (eq and name.startswith(prefix)):
            continue
        key = name[len(prefix):]
        problem = section_key_problem(key, SECTION)
        if problem:
            raise ConfigError(problem)
        try:
            keys[key] = yaml.safe_load(value) if value else None
        except yaml.YAMLError:
            keys[key] = value
    return ReplayConfig.resolve_with_origin(keys or None, section_name=f"{SECTION} (command line)")


def parse_cli(argv: Sequence[str]) -> Any:
    """A SkyRL command line parsed by SkyRL's parser into :func:`skyrl_config_class`, without the
    dispatch key ``trainer.override_entrypoint=...`` (as SkyRL's own ``main`` drops it)."""
    return skyrl_config_class().from_cli_overrides([a for a in argv if not a.startswith(_ENTRYPOINT)])


def replay_config_from_skyrl(cfg: Any, argv: Optional[Sequence[str]] = None) -> tuple[ReplayConfig, str]:
    """The parsed section merged with ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, and where it came
    from; ``argv`` tells the keys the command line set (else a key at its default counts as unset)."""
    section = getattr(getattr(cfg, "trainer", None), "r3bridge", None)
    named = None if argv is None else section_keys(argv, SECTION)
    # the environment (R3BRIDGE_CONFIG) merges with the command line's keys (r3bridge.config)
    return ReplayConfig.resolve_with_origin(section if isinstance(section, ReplayConfig) else None,
                                            section_name=f"{SECTION} (command line)", set_keys=named)


def prepare_skyrl_config(cfg: Any, argv: Optional[Sequence[str]] = None, *,
                         announce_where: Optional[str] = None) -> ReplayConfig:
    """Fill ``trainer.r3bridge`` (``argv``: :func:`replay_config_from_skyrl`'s), announce it in
    ``announce_where``, refuse contradictions (``ConfigError`` naming both keys), and set
    ``moe_enable_routing_replay`` under R3 for SkyRL's ``validate_cfg`` only (docs, "Configuration")."""
    rc, origin = replay_config_from_skyrl(cfg, argv)
    if announce_where is not None:
        announce(rc, origin, announce_where)
    cfg.trainer.r3bridge = rc
    ie = cfg.generator.inference_engine
    mc = cfg.trainer.policy.megatron_config
    ref_mc = getattr(getattr(cfg.trainer, "ref", None), "megatron_config", None)
    check = JobCheck(rc, SECTION, "SkyRL config", true="true", false="false")
    # SkyRL's reference worker would replay the actor's rollout routes (NeMo RL #4083's teacher)
    check.reference_replay("trainer.ref.megatron_config.moe_enable_routing_replay",
                           getattr(ref_mc, "moe_enable_routing_replay", False), off=False).raise_if_any(RoleError)
    check.all_hidden_layers("vLLM")
    spec = speculative_decoding_problem(rc.replay_mode.value, "vllm", speculative_settings(cfg),
                                        configured_version=rc.engine_version)
    check.refuse(spec, spec)
    kv = kv_transfer_problem(rc.replay_mode.value, "vllm", kv_transfer_settings(cfg))
    check.refuse(kv, kv)
    check.rollout_routes("generator.inference_engine.enable_return_routed_experts",
                         bool(getattr(ie, "enable_return_routed_experts", False)), engine="vLLM")
    if rc.replay_mode is ReplayMode.R2:
        check.framework_replay("trainer.policy.megatron_config.moe_enable_routing_replay",
                               bool(mc.moe_enable_routing_replay), off=False)
    check.raise_if_any()
    if rc.replay_mode is ReplayMode.R3:
        mc.moe_enable_routing_replay = True     # SkyRL's check only: r3bridge's worker keeps it off
    return rc


def kv_transfer_settings(cfg: Any) -> dict[str, Any]:
    """The SkyRL settings that serve rollouts through prefill / decode disaggregation or a vLLM KV
    connector (``engine_settings.KV_TRANSFER_SETTINGS``' names): ``enable_pd`` and any
    ``kv_transfer_config`` passed through to vLLM."""
    ie = cfg.generator.inference_engine
    out: dict[str, Any] = {}
    if getattr(ie, "enable_pd", False):
        out["disaggregation_mode"] = f"generator.inference_engine.enable_pd=true, num_prefill={getattr(ie, 'num_prefill', 0)}"
    for kw in ("engine_init_kwargs", "prefill_init_kwargs", "decode_init_kwargs"):
        kv = (getattr(ie, kw, None) or {}).get("kv_transfer_config")
        if kv:
            out["kv_transfer_config"] = kv
    return out


def speculative_settings(cfg: Any, environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The SkyRL settings that turn vLLM speculative decoding on (docs, "Speculative decoding")."""
    env = os.environ if environ is None else environ
    ie = "generator.inference_engine"
    kwargs = ("engine_init_kwargs", "prefill_init_kwargs", "decode_init_kwargs")     # passed through to vLLM
    paths = [f"{ie}.speculative_config", "trainer.mtp.enabled", *(f"{ie}.{kw}.speculative_config" for kw in kwargs)]
    if env.get("SKYRL_DISABLE_SPEC") == "1":     # SkyRL then writes no MTP speculative_config
        paths.remove("trainer.mtp.enabled")
    return {p: v for p in paths if (v := setting(cfg, p, plain=True))}
