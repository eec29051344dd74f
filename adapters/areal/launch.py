"""AReaL's local launcher, with r3bridge's checks first.

    python3 -m r3bridge.adapters.areal.launch SCRIPT --config YAML [key=value ...]

It takes exactly the arguments of ``python3 -m areal.infra.launcher.local`` and then runs that launcher,
unchanged (``areal.infra.launcher.local.main``). Before AReaL's launcher starts anything:

* the config is parsed as the script parses it (AReaL's parser with :func:`grpo_config_class`): a bad
  ``r3bridge`` value or key is refused in one line, and the replay mode in force is announced, so a
  YAML without an ``r3bridge:`` section is a WARNING at launch, not first in the actor after SGLang,
  the tokenizer and the model;
* what AReaL 1.0.4's launcher needs, and would otherwise fail on late or wait for without a word, is
  checked (:func:`problems`: one line each, exit status 2); missing ``cluster.fileroot`` and
  name-resolve folders, which AReaL requires to exist, are created;
* while AReaL's launcher waits for its inference servers to register, :class:`ServerWait` says every
  minute what it waits for, and stops the launch once every server process has exited without
  registering (AReaL's server wrapper polls a dead server forever, and its launcher waits 1200 s).
"""
from __future__ import annotations

import _thread
import getpass
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from r3bridge.adapters.areal._compat import import_areal
from r3bridge.adapters.areal.config import grpo_config_class, parse_cli, section_of
from r3bridge.announce import announce
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.errors import ReplayError

__all__ = ["main", "problems", "ServerWait", "SERVER_MODULES"]

logger = logging.getLogger("r3bridge")
WHERE = "AReaL launcher"
# the inference server each backend's wrapper starts (AReaL 1.0.4: SGLangConfig / vLLMConfig.build_cmd_from_args)
SERVER_MODULES = {"sglang": "areal.experimental.inference_service.sglang.launch_server",
                  "vllm": "areal.engine.vllm_ext.areal_vllm_server"}
_WRAPPERS = {"sglang": "areal.infra.launcher.sglang_server", "vllm": "areal.infra.launcher.vllm_server"}
# wait_llm_server_addrs' default in AReaL 1.0.4 (areal/infra/utils/launcher.py)
AREAL_SERVER_WAIT_S = 1200


def _refuse(lines: list[str]) -> None:
    for line in lines:
        print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def problems(config: Any, raw: Any, gen_backend: Optional[str], *, platform: Any) -> list[str]:
    """What stops AReaL 1.0.4's local launcher with this config on this machine, one line each.

    ``raw``: AReaL's unstructured config (what its launcher reads); ``config``: the same parsed with
    the ``r3bridge`` section (``None`` when the script's config class is not ``GRPOConfig``: the
    section is then checked in the trainer); ``gen_backend``: the allocation's inference backend;
    ``platform``: AReaL's ``current_platform``."""
    out = []
    if config is not None:
        section, _ = ReplayConfig.resolve_with_origin(section_of(config))
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
    wanted = [("cluster.fileroot", cluster.fileroot)]
    if cluster.name_resolve.type == "nfs":
        wanted.append(("cluster.name_resolve.nfs_record_root", cluster.name_resolve.nfs_record_root))
    for key, path in wanted:
        if path and not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            logger.warning("r3bridge (%s): created %s %s (AReaL requires it to exist; on several nodes it "
                           "must be a shared file system)", WHERE, key, path)


class ServerWait:
    """AReaL's launcher waiting for its inference servers to register: what it waits for, and whether
    it still can. :meth:`poll` returns ``None`` while waiting quietly, else a line: progress (every
    ``report_every`` s), done, or failed (:attr:`failed`: every wrapper or server process seen has
    exited and fewer than ``expected`` servers registered)."""

    def __init__(self, backend: str, expected: int, registered: Callable[[], int],
                 running: Callable[[str], int], log_path: str, *, report_every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.expected, self.log_path = backend, expected, log_path
        self._registered, self._running, self._clock = registered, running, clock
        self.report_every = report_every
        self.start = self._last = clock()
        self._seen: set[str] = set()
        self.done = self.failed = False

    def poll(self) -> Optional[str]:
        alive = {what: self._running(module) for what, module in
                 (("wrapper", _WRAPPERS[self.backend]), ("server", SERVER_MODULES[self.backend]))}
        self._seen |= {what for what, n in alive.items() if n}
        waited = self._clock() - self.start
        if "wrapper" in self._seen:          # AReaL clears old registrations before it starts the wrapper
            n = self._registered()
            if n >= self.expected:
                self.done = True
                return f"{n} {self.backend} server(s) registered after {waited:.0f} s"
        if self._seen and not any(alive[what] for what in self._seen):
            self.failed = True
            return (f"the {self.backend} server process(es) exited before registering ({waited:.0f} s after launch); "
                    f"their output: {self.log_path}")
        if self._clock() - self._last >= self.report_every:
            self._last = self._clock()
            return (f"waiting {waited:.0f} s for {self.expected} {self.backend} server(s) to register "
                    f"({alive['server']} server process(es) running; AReaL's launcher gives up after "
                    f"{AREAL_SERVER_WAIT_S} s); their output: {self.log_path}")
        return None


def _running(module: str) -> int:
    """Processes below this one whose command line runs ``module``."""
    import psutil

    count = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            count += module in " ".join(proc.cmdline())
        except psutil.Error:
            continue
    return count


def _watch(wait: ServerWait, stop: threading.Event, interval: float = 2.0) -> None:
    while not stop.wait(interval):
        line = wait.poll()
        if line is None:
            continue
        if wait.failed:
            logger.error("r3bridge (%s): %s; stopping the launch", WHERE, line)
            _thread.interrupt_main()         # AReaL's launcher stops its jobs on KeyboardInterrupt
            return
        logger.warning("r3bridge (%s): %s", WHERE, line)
        if wait.done:
            return


def _parse(argv: list[str]) -> Any:
    """The config as the guide's script reads it (``GRPOConfig`` + the ``r3bridge`` section); ``None``
    when the script's own config class has keys ``GRPOConfig`` lacks (said in one line)."""
    try:
        return parse_cli(argv, grpo_config_class())
    except ReplayError as e:
        _refuse([f"{type(e).__name__}: r3bridge: {e}"])
    except Exception as e:  # noqa: BLE001 - AReaL's parser (hydra, omegaconf): about r3bridge, or another class
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "r3bridge" in str(e) or "ReplayConfig" in str(e):
            _refuse([f"r3bridge: {first}"])
        logger.warning("r3bridge (%s): the config is not GRPOConfig + r3bridge (%s); its r3bridge section is "
                       "checked and announced by the actor", WHERE, first)
    return None


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cli_args = import_areal("areal.api.cli_args")
    config = _parse(argv)
    if config is not None:
        announce(*ReplayConfig.resolve_with_origin(section_of(config)), WHERE)
    raw, _ = cli_args.parse_cli_args(argv)                # what AReaL's launcher reads
    alloc = import_areal("areal.api.alloc_mode")._AllocationMode.from_str(raw.allocation_mode)
    platform = import_areal("areal.infra.platforms").current_platform
    found = problems(config, raw, alloc.gen_backend, platform=platform)
    if found:
        _refuse(found)
    cluster = cli_args.to_structured_cfg(raw.get("cluster", {}), cli_args.ClusterSpecConfig)
    _folders(cluster)

    local = import_areal("areal.infra.launcher.local")
    stop = threading.Event()
    if alloc.gen_backend in SERVER_MODULES:
        name_resolve, names = import_areal("areal.utils.name_resolve"), import_areal("areal.utils.names")
        key = names.gen_servers(raw.experiment_name, raw.trial_name)
        log_path = os.path.join(cluster.fileroot, "logs", getpass.getuser(), raw.experiment_name, raw.trial_name,
                                "llm_server.log")
        wait = ServerWait(alloc.gen_backend, alloc.gen.dp_size, lambda: len(name_resolve.get_subtree(key)),
                          _running, log_path)
        threading.Thread(target=_watch, args=(wait, stop), name="r3bridge-server-wait", daemon=True).start()
    sys.argv = [local.__file__, *argv]
    try:
        local.main()
    except KeyboardInterrupt:
        raise SystemExit(1) from None
    finally:
        stop.set()


if __name__ == "__main__":
    main()
