"""The only part of r3bridge that touches megatron-core objects.

`Replayer` finds each model chunk's decoder routers, attaches r3bridge's hook object to
``router.router_replay`` (the call site megatron-core >= 0.16 already has: no class is patched and
no routing math is re-implemented) and runs one `ReplayStep` per schedule: R3 / R2 replay, R2
recording with tensor-collective gathering, per-layer agreement metrics. `PhaseRunner` runs one
framework phase around the driver for the adapters. See docs/driver-api.md.
"""
from r3bridge.config import Action
from r3bridge.megatron.compat import MIN_MEGATRON_CORE, check_megatron
from r3bridge.megatron.guards import check_config
from r3bridge.megatron.phase import MicroBatch, PhaseResult, PhaseRunner, PhaseStep, install_before_forward
from r3bridge.megatron.replayer import Replayer
from r3bridge.megatron.step import ReplayStep

__all__ = ["Replayer", "ReplayStep", "Action", "check_config", "check_megatron", "MIN_MEGATRON_CORE",
           "PhaseRunner", "PhaseStep", "PhaseResult", "MicroBatch", "install_before_forward"]
