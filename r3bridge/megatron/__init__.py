"""The driver: the only part of r3bridge that touches megatron-core objects.

`Replayer` finds each model chunk's decoder routers, attaches r3bridge's hook object to
``router.router_replay`` (the call site megatron-core >= 0.16 already has: no class is patched and
no routing math is re-implemented) and hands out one `ReplayPass` per pass (one schedule run): R3 /
R2 replay, R2 recording with tensor-collective gathering, per-layer agreement metrics. A
`MicroBatch` is what an adapter installs for one micro-batch. The adapter seam around it (an
adapter's set-up and its phases' passes) is :mod:`r3bridge.session`. See docs/driver-api.md.
"""
from r3bridge.config import Action
from r3bridge.megatron.compat import MIN_MEGATRON_CORE, check_megatron
from r3bridge.megatron.guards import check_config
from r3bridge.megatron.replay_pass import MicroBatch, ReplayPass
from r3bridge.megatron.replayer import Replayer

__all__ = ["Replayer", "ReplayPass", "MicroBatch", "Action", "check_config", "check_megatron", "MIN_MEGATRON_CORE"]
