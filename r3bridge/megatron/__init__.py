"""The only part of r3bridge that touches megatron-core objects.

`Replayer` finds each model chunk's decoder routers, attaches r3bridge's hook object to
``router.router_replay`` (the call site megatron-core >= 0.16 already has: no class is patched and
no routing math is re-implemented) and runs one `ReplayPass` per pass (one schedule run): R3 / R2
replay, R2 recording with tensor-collective gathering, per-layer agreement metrics. `PhaseRunner`
runs one pass of a framework phase around the driver; `AdapterSession` is an adapter's whole
set-up (config, announce, replayer, runner, roles, metrics). See docs/driver-api.md.
"""
from r3bridge.config import Action
from r3bridge.megatron.compat import MIN_MEGATRON_CORE, check_megatron
from r3bridge.megatron.guards import check_config
from r3bridge.megatron.phase import PhaseResult, PhaseRunner, install_before_forward
from r3bridge.megatron.replay_pass import MicroBatch, ReplayPass
from r3bridge.megatron.replayer import Replayer
from r3bridge.megatron.session import AdapterSession

__all__ = ["Replayer", "ReplayPass", "Action", "check_config", "check_megatron", "MIN_MEGATRON_CORE",
           "PhaseRunner", "PhaseResult", "MicroBatch", "install_before_forward", "AdapterSession"]

