"""Launch time: what a framework's launcher does around the framework's own launch.

* ``preflight``   - a launcher's steps before the framework starts (one-line refusals, the section's
                    keys on a command line, required folders, the inference-server wait), re-exported here

Nothing here runs inside a training step; the data path starts at :mod:`r3bridge.engines`.
"""
from r3bridge.launch.preflight import (
    ServerWait,
    ensure_folders,
    refuse,
    refusing_section_errors,
    running_processes,
    section_keys,
    watch_servers,
)

__all__ = ["refuse", "refusing_section_errors", "section_keys", "ensure_folders", "ServerWait", "running_processes",
           "watch_servers"]
