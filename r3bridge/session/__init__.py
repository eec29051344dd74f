"""The adapter seam: what an adapter calls around the driver (:mod:`r3bridge.megatron`).

* ``adapter_session``    - ``AdapterSession``: an adapter's whole set-up (config resolved and
                           announced, the replayer attached, roles, metrics) and its phases' passes
* ``phase``              - ``PhaseRunner``: one pass of a framework phase (compute_log_prob, update)
                           around the driver, its ``PhaseResult``, the trace of the pass
* ``packed_micro_batch`` - a framework's THD micro-batch (with its trailing page padding) as the
                           ``MicroBatch`` the driver installs

An adapter builds one ``AdapterSession`` per model and runs each phase through it; docs/porting.md.
"""
from r3bridge.session.adapter_session import AdapterSession, declared_session
from r3bridge.session.phase import PhaseResult, PhaseRunner, install_before_forward

__all__ = ["AdapterSession", "declared_session", "PhaseRunner", "PhaseResult", "install_before_forward"]
