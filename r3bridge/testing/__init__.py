"""The adapter author's kit: real megatron-core GPT+MoE models on gloo ranks, and the conformance checks.

What ships for whoever writes an adapter (docs/porting.md), in two parts. Product code imports only
harness pieces the demo's CPU ranks run on (``dist``, ``models``, ``data``, ``schedule``, ``probe``),
and the CPU shims are installed only inside processes started by :func:`harness.dist.spawn` (see
docs/testing-harness.md). r3bridge's own framework runners are not here: they live in the
repository's ``testlab/`` and are not shipped.

Submodules (imported lazily so ``import r3bridge.testing`` stays cheap and megatron-free):

``harness/`` - the CPU Megatron harness (also what the demo's CPU ranks run on):

* ``cpu_shim``  - the minimal CUDA-only call shims (``apply()``)
* ``dist``      - ``spawn`` / ``spawn_layouts``, ``Layout``, ``RankContext``, ``RankError``
* ``models``    - ``ModelSpec``, ``build_model_chunks``, deterministic init, reference state
* ``data``      - packed batches, CP zigzag split, router row -> token mapping
* ``schedule``  - forward step, ``run_schedule``, gradient sync, optimizer helpers
* ``probe``     - ``RoutingProbe`` (router call recorder), ``topk_indices``

``kit/`` - the conformance checks an adapter passes, run on the harness:

* ``rollouts``    - ``ModelShape``, ``CanonicalRollout``, ``make_rollout`` (what the checks run on)
* ``runner``      - the ``MegatronRunner`` contract of checks 4-5 and its helpers (``pack_thd``, ...)
* ``conformance`` - checks 1-5 as functions that pass or fail (docs/porting.md)
* ``suite``       - the same checks as pytest base classes (``BaseIngestTests``, ``BaseMegatronTests``)

Every name below is importable from ``r3bridge.testing`` itself.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "spawn": "harness.dist",
    "spawn_layouts": "harness.dist",
    "Layout": "harness.dist",
    "RankContext": "harness.dist",
    "RankError": "harness.dist",
    "ModelSpec": "harness.models",
    "build_model_chunks": "harness.models",
    "load_reference_state": "harness.models",
    "canonical_state_dict": "harness.models",
    "PackedBatch": "harness.data",
    "make_packed_batch": "harness.data",
    "align_for": "harness.data",
    "cp_zigzag_index": "harness.data",
    "router_row_index": "harness.data",
    "make_forward_step": "harness.schedule",
    "run_schedule": "harness.schedule",
    "make_optimizer": "harness.schedule",
    "optimizer_step": "harness.schedule",
    "sync_grads": "harness.schedule",
    "RoutingProbe": "harness.probe",
    "topk_indices": "harness.probe",
    "ModelShape": "kit.rollouts",
    "CanonicalRollout": "kit.rollouts",
    "make_rollout": "kit.rollouts",
    "MegatronRunner": "kit.runner",
    "pack_thd": "kit.runner",
    "unpack_rows": "kit.runner",
    "record_packing": "kit.runner",
    "run_megatron_checks": "kit.conformance",
    "assert_megatron_checks": "kit.conformance",
    "BaseIngestTests": "kit.suite",
    "BaseMegatronTests": "kit.suite",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
