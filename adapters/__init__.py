"""Framework adapters, importable as ``r3bridge.adapters``: ``verl``, ``skyrl``, ``areal`` and the
``_template`` for new ones.

Adapters import ``r3bridge``, never each other. Each translates its framework's batches to and
from :class:`r3bridge.ReplayBatch` and calls the Megatron driver at the framework's per-micro-batch
hook (:mod:`r3bridge.protocols`); each passes :mod:`r3bridge.testing.kit.conformance` (docs/porting.md).
"""
