"""The ``r3bridge`` section of a verl config, its validation, and how it reaches the workers.

verl hands each Ray worker only ``actor_rollout_ref``, so the section travels as ``R3BRIDGE_CONFIG``
in Ray's runtime env: :func:`prepare_verl_config` (the launcher) validates the whole job config and
puts it there; the engine re-checks what it can see itself (:func:`check_engine_config`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping

from r3bridge.adapters.verl.route_handles import check_route_store, launch_run_id
from r3bridge.announce import announce
from r3bridge.config import ReplayConfig, ReplayMode, forward_env
from r3bridge.engines.engine_settings import kv_transfer_problem, speculative_decoding_problem
from r3bridge.hf import moe_layer_ids_from_hf_config
from r3bridge.job_check import JobCheck, interpolated, setting

__all__ = ["resolve_verl_options", "validate_verl_config", "check_engine_config", "prepare_verl_config",
           "speculative_settings", "kv_transfer_settings", "forward_section", "local_hf_config"]

ADAPTER_MODULE = "r3bridge.adapters.verl"

_ACTOR = "actor_rollout_ref.actor"
_MEGATRON = "actor_rollout_ref.actor.megatron"
SECTION_NAME = "the job's r3bridge section (r3bridge.* on the command line or in your YAML)"


def resolve_verl_options(verl_cfg: Any, environ: Mapping[str, str] | None = None) -> tuple[ReplayConfig, str]:
    """The options in force for a verl job and their origin (:meth:`ReplayConfig.resolve_with_origin`)."""
    return ReplayConfig.resolve_with_origin(setting(verl_cfg, "r3bridge", None, plain=True), environ,
                                            section_name=SECTION_NAME)


def _check(cfg: ReplayConfig, f: Mapping[str, Any], where: str, hf_config: Any = None) -> None:
    """Everything that makes exact replay impossible, given the facts ``f`` and ``hf_config`` (None: unknown)."""
    check = JobCheck(cfg, "r3bridge", where)
    check.refuse(f.get("strategy") not in (None, "megatron"), f"{_ACTOR}.strategy={f.get('strategy')!r}: the r3bridge "
                 f"verl adapter drives Megatron only (set it to 'megatron')")
    check.framework_replay(f"{_MEGATRON}.router_replay.mode", f.get("verl_router_replay"), off="disabled")
    check.reference_replay("actor_rollout_ref.ref.megatron.router_replay.mode", f.get("ref_router_replay"),
                           off="disabled")
    check.rollout_routes("actor_rollout_ref.rollout.enable_rollout_routing_replay", f.get("rollout_routes"))
    check.refuse(cfg.replay_mode is ReplayMode.R2 and f.get("bypass_mode"), "algorithm.rollout_correction."
                 "bypass_mode=True: R2 records routes in the old-log-prob forward (compute_log_prob), which bypass "
                 "mode skips; set bypass_mode=False")
    check.refuse(f.get("use_remove_padding") is False, "actor_rollout_ref.model.use_remove_padding=False: replay "
                 "needs the packed (THD) layout; set use_remove_padding=True")
    check.refuse(f.get("pad_to_length"), f"{_MEGATRON}.pad_to_length=True: bucket padding of the packed "
                 f"micro-batch is not supported with routing replay; set it to False")
    check.refuse(f.get("router_fusion"), f"{_MEGATRON}.override_transformer_config.moe_router_fusion=True: the "
                 f"fused router bypasses the replay hook; set it to False")
    check.refuse(f.get("dynamic_cp"), f"{_MEGATRON}.dynamic_context_parallel=True: dynamic CP re-packs "
                 f"micro-batches outside the engine; not supported with r3bridge replay")
    check.refuse(f.get("cp_layout") not in (None, "zigzag"), f"context-parallel layout {f.get('cp_layout')!r}: "
                 f"only verl's zigzag CP layout is supported")
    check.refuse(f.get("speculative"), f.get("speculative"))
    check.refuse(f.get("kv_transfer"), f.get("kv_transfer"))
    check.refuse(check_route_store(cfg) is not None, check_route_store(cfg))
    check.moe_model(None if hf_config is None else moe_layer_ids_from_hf_config(hf_config)).raise_if_any()


def validate_verl_config(verl_cfg: Any, hf_config: Any = None, cfg: ReplayConfig | None = None) -> ReplayConfig:
    """Validate a whole verl job config (driver side): the options in force (``cfg``, else the
    job's), or one :class:`ConfigError` listing every problem. ``hf_config``: for the MoE check."""
    if cfg is None:
        cfg = resolve_verl_options(verl_cfg)[0]
    s = lambda path, d=None: setting(verl_cfg, path, d)  # noqa: E731
    _check(cfg, {
        "strategy": s(f"{_ACTOR}.strategy"),
        "verl_router_replay": s(f"{_MEGATRON}.router_replay.mode"),
        "ref_router_replay": s("actor_rollout_ref.ref.megatron.router_replay.mode"),
        "rollout_routes": bool(s("actor_rollout_ref.rollout.enable_rollout_routing_replay", False)),
        "bypass_mode": bool(s("algorithm.rollout_correction.bypass_mode", False)),
        "use_remove_padding": s("actor_rollout_ref.model.use_remove_padding"),
        "pad_to_length": s(f"{_MEGATRON}.pad_to_length"),
        "router_fusion": s(f"{_MEGATRON}.override_transformer_config.moe_router_fusion"),
        "dynamic_cp": s(f"{_MEGATRON}.dynamic_context_parallel"),
        # R3 + a speculative draft on an engine release that lets it overwrite the routes (engine_settings)
        "speculative": speculative_decoding_problem(cfg.replay_mode.value, *speculative_settings(verl_cfg),
                                                    configured_version=cfg.engine_version),
        # R3 + rollouts whose prompt KV comes from another node (prefill / decode disaggregation, a KV connector)
        "kv_transfer": kv_transfer_problem(cfg.replay_mode.value, *kv_transfer_settings(verl_cfg)),
    }, "verl config", hf_config)
    return cfg


def kv_transfer_settings(verl_cfg: Any) -> tuple[str | None, dict[str, Any]]:
    """(the rollout engine, the verl 0.9 settings that serve rollouts through prefill / decode
    disaggregation or a KV connector: SGLang's ``rollout.disaggregation.enabled``, a vLLM
    ``kv_transfer_config`` in the engine kwargs), named as ``engine_settings.KV_TRANSFER_SETTINGS``."""
    s = lambda path, d=None: setting(verl_cfg, path, d)  # noqa: E731
    engine = s("actor_rollout_ref.rollout.name")
    engine = None if engine is None else str(engine).lower()
    out: dict[str, Any] = {}
    if bool(s("actor_rollout_ref.rollout.disaggregation.enabled", False)):
        out["disaggregation_mode"] = ("actor_rollout_ref.rollout.disaggregation.enabled=True, transfer_backend="
                                      f"{s('actor_rollout_ref.rollout.disaggregation.transfer_backend')}")
    kv = s("actor_rollout_ref.rollout.engine_kwargs.vllm.kv_transfer_config")
    if kv:
        out["kv_transfer_config"] = setting(verl_cfg, "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_transfer_config",
                                            plain=True)
    return engine, out


def speculative_settings(verl_cfg: Any) -> tuple[str | None, dict[str, Any]]:
    """(the rollout engine, the verl 0.9 settings that turn speculative decoding on in it: the MTP
    draft, vLLM's ``speculative_config``, SGLang's ``speculative_algorithm``)."""
    s = lambda path, d=None: setting(verl_cfg, path, d)  # noqa: E731
    engine = s("actor_rollout_ref.rollout.name")
    engine = None if engine is None else str(engine).lower()
    out: dict[str, Any] = {}
    # verl's servers read rollout.mtp, by default ${actor_rollout_ref.model.mtp}: name the key the user wrote
    own = s("actor_rollout_ref.rollout.mtp") is not None and not interpolated(verl_cfg, "actor_rollout_ref.rollout.mtp")
    mtp = "actor_rollout_ref.rollout.mtp" if own else "actor_rollout_ref.model.mtp"
    if bool(s(f"{mtp}.enable", False)) and bool(s(f"{mtp}.enable_rollout", False)):
        out[f"{mtp}.enable"] = out[f"{mtp}.enable_rollout"] = True
    kwargs = "actor_rollout_ref.rollout.engine_kwargs"
    if engine == "vllm" and s(f"{kwargs}.vllm.speculative_config"):
        out[f"{kwargs}.vllm.speculative_config"] = setting(verl_cfg, f"{kwargs}.vllm.speculative_config", plain=True)
    if engine == "sglang" and s(f"{kwargs}.sglang.speculative_algorithm"):
        out[f"{kwargs}.sglang.speculative_algorithm"] = s(f"{kwargs}.sglang.speculative_algorithm")
    return engine, out


def check_engine_config(cfg: ReplayConfig, engine_config: Any, hf_config: Any = None,
                        tf_config: Any = None, cp_layout: str | None = None) -> None:
    """What a worker's engine can check itself (its engine config, HF and Transformer configs)."""
    _check(cfg, {
        "verl_router_replay": setting(engine_config, "router_replay.mode"),
        "use_remove_padding": setting(engine_config, "use_remove_padding"),
        "pad_to_length": setting(engine_config, "pad_to_length"),
        "dynamic_cp": setting(engine_config, "dynamic_context_parallel"),
        "router_fusion": getattr(tf_config, "moe_router_fusion", None) if tf_config is not None else None,
        "cp_layout": cp_layout,
    }, "Megatron engine config", hf_config)


def prepare_verl_config(verl_cfg: Any, hf_config: Any = None, *, announce_where: str | None = None,
                        worker_env: Mapping[str, str] | None = None) -> ReplayConfig:
    """Driver side: resolve and validate the options, forward them to every Ray worker
    (:func:`forward_section`), make the workers import the adapter even with verl
    plugins off and (replay on) register the engine here too. ``announce_where``: log the startup
    line naming it. ``worker_env``: variables for the workers only (the stall-watchdog id)."""
    cfg, origin = resolve_verl_options(verl_cfg)
    if hf_config is None:
        hf_config = local_hf_config(setting(verl_cfg, "actor_rollout_ref.model.path"), trust_remote_code=bool(
            setting(verl_cfg, "actor_rollout_ref.model.trust_remote_code", False)))
    validate_verl_config(verl_cfg, hf_config, cfg)
    if announce_where is not None:
        announce(cfg, origin, announce_where)
    # routes by reference: one run id for the rollout and trainer workers (and killed runs' files removed)
    worker_env = {**(worker_env or {}), **launch_run_id(cfg)}
    forward_section(verl_cfg, cfg, announce_where or "verl launcher", worker_env=worker_env)
    model = setting(verl_cfg, "actor_rollout_ref.model")
    if cfg.replay_mode is not ReplayMode.OFF and model is not None:
        # verl imports external_lib in every worker and, unlike its plugin loader, lets an import
        # error fail the worker; it takes a list, so a user's own module stays
        _ensure_listed(model, "external_lib", ADAPTER_MODULE)
        from r3bridge.adapters.verl import register
        register()      # a worker in this process (imported verl before the mode was known)
    return cfg


WORKER_ENV_PATH = "ray_kwargs.ray_init.runtime_env.env_vars"     # Ray's runtime env: every worker's environment


def forward_section(verl_cfg: Any, cfg: ReplayConfig, where: str, *,
                    worker_env: Mapping[str, str] | None = None) -> None:
    """Hand the resolved options to every worker: written back as the job's ``r3bridge`` section,
    and as ``R3BRIDGE_CONFIG`` (plus ``worker_env``) into Ray's runtime env (:data:`WORKER_ENV_PATH`;
    verl's workers see only ``actor_rollout_ref``) and into this process's environment."""
    from omegaconf import OmegaConf, open_dict

    forward = forward_env(cfg, where)
    with open_dict(verl_cfg):
        verl_cfg["r3bridge"] = cfg.as_dict()
    node = verl_cfg
    for part in WORKER_ENV_PATH.split("."):     # every missing level created, struct mode too
        with open_dict(node):
            if node.get(part) is None:
                node[part] = OmegaConf.create({})
        node = node[part]
    with open_dict(node):
        node.update({**forward, **(worker_env or {})})
    os.environ.update(forward)


def local_hf_config(path: Any, *, trust_remote_code: bool = False) -> Any:
    """The model's HF config when ``path`` is a local folder the launcher can read; ``None`` for a
    remote name or an unreadable config (the workers check the model when they build it)."""
    if not path or not os.path.exists(os.path.expanduser(str(path))):
        return None
    try:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(os.path.expanduser(str(path)), trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001
        return None


def _ensure_listed(section: Any, key: str, item: str) -> None:
    """``item`` in ``section[key]``, a setting that takes one string or a list (``external_lib``):
    appended after the user's own entries, a lone item kept a string; OmegaConf struct mode respected."""
    from omegaconf import DictConfig, open_dict

    current = section.get(key)
    items = [] if not current else [current] if isinstance(current, str) else list(current)
    if item not in items:
        with open_dict(section) if isinstance(section, DictConfig) else contextlib.nullcontext():
            section[key] = items + [item] if items else item
