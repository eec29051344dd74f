"""The adapter author's kit: real megatron-core GPT+MoE models on gloo ranks, and the conformance checks.

What ships for whoever writes an adapter (docs/porting.md). Product code imports only the harness
pieces the demo's CPU ranks run on (``dist``, ``models``, ``data``, ``schedule``, ``probe``), and
the CPU shims are installed only inside processes started by :func:`dist.spawn` (see
docs/testing-harness.md). r3bridge's own framework runners are not here: they live in the
repository's ``testlab/`` and are not shipped.

Submodules (imported lazily so ``import r3bridge.testing`` stays cheap and megatron-free):

* ``cpu_shim``  - the minimal CUDA-only call shims (``apply()``)
* ``dist``      - ``spawn`` / ``spawn_layouts``, ``Layout``, ``RankContext``, ``RankError``
* ``models``    - ``ModelSpec``, ``build_model_chunks``, deterministic init, reference state
* ``data``      - packed batches, CP zigzag split, router row -> token mapping
* ``schedule``  - forward step, ``run_schedule``, gradient sync, optimizer helpers
* ``probe``     - ``RoutingProbe`` (router call recorder), ``topk_indices``
* ``rollouts``  - ``ModelShape``, ``CanonicalRollout``, ``make_rollout`` (what the checks run on)
* ``runner``    - the ``MegatronRunner`` contract of checks 4-5 and its helpers (``pack_thd``, ...)
* ``conformance`` - checks 1-5 as functions that pass or fail (docs/porting.md)
* ``suite``     - the same checks as pytest base classes (``BaseIngestTests``, ``BaseMegatronTests``)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "spawn": "dist",
    "spawn_layouts": "dist",
    "Layout": "dist",
    "RankContext": "dist",
    "RankError": "dist",
    "ModelSpec": "models",
    "build_model_chunks": "models",
    "load_reference_state": "models",
    "canonical_state_dict": "models",
    "PackedBatch": "data",
    "make_packed_batch": "data",
    "align_for": "data",
    "cp_zigzag_index": "data",
    "router_row_index": "data",
    "make_forward_step": "schedule",
    "run_schedule": "schedule",
    "make_optimizer": "schedule",
    "optimizer_step": "schedule",
    "sync_grads": "schedule",
    "RoutingProbe": "probe",
    "topk_indices": "probe",
    "ModelShape": "rollouts",
    "CanonicalRollout": "rollouts",
    "make_rollout": "rollouts",
    "MegatronRunner": "runner",
    "pack_thd": "runner",
    "unpack_rows": "runner",
    "record_packing": "runner",
    "run_megatron_checks": "conformance",
    "assert_megatron_checks": "conformance",
    "BaseIngestTests": "suite",
    "BaseMegatronTests": "suite",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
