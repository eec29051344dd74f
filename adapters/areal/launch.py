"""AReaL's local launcher, with r3bridge's checks first.

    python3 -m r3bridge.adapters.areal.launch SCRIPT --config YAML [key=value ...]

It takes exactly the arguments of ``python3 -m areal.infra.launcher.local`` and runs that launcher
unchanged, after the steps of :mod:`r3bridge.launch` with AReaL's parser: a bad ``R3BRIDGE_*``
variable, a missing SCRIPT or YAML (relative paths are the current folder's, as for AReaL's own
launcher; they reach AReaL's launcher absolute), the section's keys and values, the section against
AReaL's own settings (:func:`job_check`, SkyRL's words), what AReaL 1.0.4's launcher would fail on
late or wait for without a word (:func:`problems`), its folders and its server wait
(:func:`server_wait`). docs/use-with-areal.md, "What runs where".
"""
from __future__ import annotations

import getpass
import importlib.util
import os
import sys
from typing import Any, Callable, Optional

from r3bridge.adapters.areal._compat import import_areal
from r3bridge.adapters.areal.config import grpo_config_class, parse_cli
from r3bridge.adapters.areal.parse_and_run import parse_announced, run_framework_main
from r3bridge.announce import ensure_visible
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.errors import ConfigError
from r3bridge.job_check import JobCheck, environment_setting, replay_section
from r3bridge.launch import ServerWait, ensure_folders, refuse, watch_servers

__all__ = ["main", "problems", "job_check", "absolute_paths", "server_wait", "SERVER_MODULES"]

WHERE = "AReaL launcher"
# the inference server each backend's wrapper starts (AReaL 1.0.4: SGLangConfig / vLLMConfig.build_cmd_from_args)
SERVER_MODULES = {"sglang": "areal.experimental.inference_service.sglang.launch_server",
                  "vllm": "areal.engine.vllm_ext.areal_vllm_server"}
_WRAPPERS = {"sglang": "areal.infra.launcher.sglang_server", "vllm": "areal.infra.launcher.vllm_server"}
# wait_llm_server_addrs' default in AReaL 1.0.4 (areal/infra/utils/launcher.py)
AREAL_SERVER_WAIT_S = 1200


def absolute_paths(argv: list[str], cwd: Optional[str] = None) -> list[str]:
    """The command line with its SCRIPT (a first argument ending in ``.py``) and ``--config`` YAML made
    absolute against ``cwd`` (default: the current folder, where AReaL's own launcher reads them), so
    the trainers AReaL starts read the same files whatever their folder; a missing one is refused in
    one line naming the path and the folder it was looked for in."""
    base = os.getcwd() if cwd is None else cwd
    out, missing = list(argv), []
    where = [0] if out and out[0].endswith(".py") else []
    where += [i + 1 for i, a in enumerate(out[:-1]) if a == "--config"]
    for i in where:
        path = os.path.abspath(os.path.join(base, os.path.expanduser(out[i])))
        if not os.path.isfile(path):
            missing.append(f"{out[i]} does not exist (relative paths are taken from the current folder, {base}; "
                           "the guide's example files are in r3bridge's checkout: $R3BRIDGE/examples/areal/)")
        out[i] = path
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            path = os.path.abspath(os.path.join(base, os.path.expanduser(arg.split("=", 1)[1])))
            out[i] = f"--config={path}"
    if missing:
        refuse(*missing)
    return out


def job_check(config: Any) -> JobCheck:
    """The section against AReaL's own settings, in SkyRL's words (:class:`~r3bridge.job_check.JobCheck`):
    R3 needs SGLang's routes; R2 records the trainer's own routes, so neither returned routes (they
    would collide with them) nor a job that skips ``compute_logp`` (nothing recorded to replay)."""
    section, _ = ReplayConfig.resolve_with_origin(replay_section(config))
    check = JobCheck(section, "r3bridge", "AReaL config", true="true", false="false")
    rollout, actor = getattr(config, "rollout", None), getattr(config, "actor", None)
    check.rollout_routes("rollout.return_routed_experts", bool(getattr(rollout, "return_routed_experts", False)),
                         engine="SGLang")
    recomputes = getattr(actor, "should_compute_prox_logp", None)
    if section.replay_mode is ReplayMode.R2 and recomputes is not None and not recomputes():
        check.problems.append(
            f"actor.recompute_logprob={check.false}, actor.use_decoupled_loss={str(actor.use_decoupled_loss).lower()}, "
            f"actor.prox_logp_method={actor.prox_logp_method}: R2 records the trainer's own routes in compute_logp, "
            f"which AReaL skips with these settings (PPOActorConfig.should_compute_prox_logp): set "
            f"actor.recompute_logprob={check.true} (or use replay_mode=R3)")
    return check


def problems(config: Any, raw: Any, gen_backend: Optional[str], *, platform: Any) -> list[str]:
    """What stops AReaL 1.0.4's local launcher with this config on this machine, one line each.

    ``raw``: AReaL's unstructured config (what its launcher reads); ``config``: the same parsed with
    the ``r3bridge`` section (``None`` when the script's config class is not ``GRPOConfig``: the
    section is then checked in the trainer; else checked by :func:`job_check` first); ``gen_backend``:
    the allocation's inference backend; ``platform``: AReaL's ``current_platform``."""
    out = []
    if not platform.device_control_env_var:
        # LocalLauncher.submit_array: f"{device_control_env_var}={ids}" -> "=0 stdbuf -oL torchrun ..."
        out.append(f"AReaL's local launcher needs an accelerator; on this machine AReaL picked its "
                   f"{platform.device_name} platform, for which it starts the trainer as '=0 stdbuf -oL torchrun ...' "
                   "(/bin/sh: =0: not found; areal/infra/launcher/local.py, LocalLauncher.submit_array)")
    if gen_backend in SERVER_MODULES:
        if gen_backend not in raw:
            out.append(f"allocation_mode starts {gen_backend} servers, but the config has no '{gen_backend}:' "
                       f"section (AReaL's launcher reads it: Key '{gen_backend}' is not in struct)")
        if importlib.util.find_spec(gen_backend) is None:
            out.append(f"allocation_mode starts {gen_backend} servers ({SERVER_MODULES[gen_backend]}), but the "
                       f"'{gen_backend}' package is not installed here: AReaL's launcher would wait "
                       f"{AREAL_SERVER_WAIT_S} s for servers that never start")
    return out


def _folders(cluster: Any) -> None:
    """``cluster.fileroot`` and the NFS name-resolve root (AReaL's ``ClusterSpecConfig``): AReaL's
    launcher requires them to exist."""
    nfs_root = cluster.name_resolve.nfs_record_root if cluster.name_resolve.type == "nfs" else None
    ensure_folders(WHERE, {"cluster.fileroot": cluster.fileroot, "cluster.name_resolve.nfs_record_root": nfs_root})


def server_wait(backend: str, expected: int, registered: Callable[[], int], log_path: str, **kwargs: Any) -> ServerWait:
    """AReaL 1.0.4's wait for its ``backend`` servers: its wrapper and server modules, its bound."""
    return ServerWait(backend, expected, registered, log_path, wrapper=_WRAPPERS[backend],
                      server=SERVER_MODULES[backend], gives_up_after_s=AREAL_SERVER_WAIT_S, **kwargs)


def main(argv: Optional[list[str]] = None) -> None:
    ensure_visible()                      # the mode line (replay off: a WARNING) with its level
    try:
        environment_setting()
    except ConfigError as e:              # a bad R3BRIDGE_* variable, named as such
        refuse(f"ConfigError: {e}")
    argv = absolute_paths(list(sys.argv[1:] if argv is None else argv))
    cli_args = import_areal("areal.api.cli_args")
    # as the guide's script reads it (GRPOConfig + the section); None: the script's own class has more keys
    config = parse_announced(lambda: parse_cli(argv, grpo_config_class()), WHERE, config_class="GRPOConfig",
                             checked_by="the actor")
    if config is not None:
        try:
            job_check(config).raise_if_any()
        except ConfigError as e:
            refuse(f"ConfigError: {e}")
    raw, _ = cli_args.parse_cli_args(argv)                # what AReaL's launcher reads
    alloc = import_areal("areal.api.alloc_mode")._AllocationMode.from_str(raw.allocation_mode)
    platform = import_areal("areal.infra.platforms").current_platform
    found = problems(config, raw, alloc.gen_backend, platform=platform)
    if found:
        refuse(*found)
    cluster = cli_args.to_structured_cfg(raw.get("cluster", {}), cli_args.ClusterSpecConfig)
    _folders(cluster)

    local = import_areal("areal.infra.launcher.local")
    stop = None
    if alloc.gen_backend in SERVER_MODULES:
        name_resolve, names = import_areal("areal.utils.name_resolve"), import_areal("areal.utils.names")
        key = names.gen_servers(raw.experiment_name, raw.trial_name)
        log_path = os.path.join(cluster.fileroot, "logs", getpass.getuser(), raw.experiment_name, raw.trial_name,
                                "llm_server.log")
        stop = watch_servers(server_wait(alloc.gen_backend, alloc.gen.dp_size,
                                         lambda: len(name_resolve.get_subtree(key)), log_path), WHERE)
    run_framework_main(local.main, local.__file__, argv, stop=stop)   # AReaL's launcher stops its jobs on ^C


if __name__ == "__main__":
    main()
