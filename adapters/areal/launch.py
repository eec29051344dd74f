"""AReaL's local launcher, with r3bridge's checks first.

    python3 -m r3bridge.adapters.areal.launch SCRIPT --config YAML [key=value ...]

It takes exactly the arguments of ``python3 -m areal.infra.launcher.local`` and runs that launcher
unchanged, after the steps of :mod:`r3bridge.launch` with AReaL's parser, what AReaL 1.0.4's launcher
would fail on late or wait for without a word (:func:`problems`), its folders and its server wait
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
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.job_check import replay_section
from r3bridge.launch import ServerWait, ensure_folders, refuse, watch_servers

__all__ = ["main", "problems", "server_wait", "SERVER_MODULES"]

WHERE = "AReaL launcher"
# the inference server each backend's wrapper starts (AReaL 1.0.4: SGLangConfig / vLLMConfig.build_cmd_from_args)
SERVER_MODULES = {"sglang": "areal.experimental.inference_service.sglang.launch_server",
                  "vllm": "areal.engine.vllm_ext.areal_vllm_server"}
_WRAPPERS = {"sglang": "areal.infra.launcher.sglang_server", "vllm": "areal.infra.launcher.vllm_server"}
# wait_llm_server_addrs' default in AReaL 1.0.4 (areal/infra/utils/launcher.py)
AREAL_SERVER_WAIT_S = 1200


def problems(config: Any, raw: Any, gen_backend: Optional[str], *, platform: Any) -> list[str]:
    """What stops AReaL 1.0.4's local launcher with this config on this machine, one line each.

    ``raw``: AReaL's unstructured config (what its launcher reads); ``config``: the same parsed with
    the ``r3bridge`` section (``None`` when the script's config class is not ``GRPOConfig``: the
    section is then checked in the trainer); ``gen_backend``: the allocation's inference backend;
    ``platform``: AReaL's ``current_platform``."""
    out = []
    if config is not None:
        section, _ = ReplayConfig.resolve_with_origin(replay_section(config))
        returns = bool(getattr(getattr(config, "rollout", None), "return_routed_experts", False))
        if section.replay_mode is ReplayMode.R3 and not returns:
            out.append("r3bridge.replay_mode=R3 replays SGLang's routes, but rollout.return_routed_experts is false: "
                       "set it to true (the actor would find no routes in the first rollout)")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    cli_args = import_areal("areal.api.cli_args")
    # as the guide's script reads it (GRPOConfig + the section); None: the script's own class has more keys
    config = parse_announced(lambda: parse_cli(argv, grpo_config_class()), WHERE, config_class="GRPOConfig",
                             checked_by="the actor")
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
