"""Launch time: what a framework's launcher and its workers do around the framework's own launch.

* ``steps``       - the launcher's shared steps (one-line refusals, the section forwarded to the
                    workers, local Ray slots, the inference-server wait), re-exported here
* ``watchdog``    - which stage a launched job is stuck in, said instead of a silent hang
* ``ray_watch``   - the watchdog's Ray half: workers report progress keys, the launcher reads them
* ``plugin_load`` - an adapter registering itself where a framework imports it as a plugin, loudly
* ``hydra_job``   - a launcher composing a framework's hydra job config with the section on its command line

Nothing here runs inside a training step; the data path starts at :mod:`r3bridge.engines`.
"""
from r3bridge.launch.steps import (
    RayJobWatch,
    ServerWait,
    check_ray_cpu_slots,
    ensure_folders,
    forward_section,
    local_hf_config,
    local_ray_cpu_slots,
    merge_setting,
    refuse,
    refusing_section_errors,
    running_processes,
    section_overrides,
    watch_servers,
)

__all__ = ["refuse", "refusing_section_errors", "section_overrides", "merge_setting", "forward_section",
           "local_hf_config", "local_ray_cpu_slots", "check_ray_cpu_slots", "ensure_folders", "RayJobWatch",
           "ServerWait", "running_processes", "watch_servers"]
