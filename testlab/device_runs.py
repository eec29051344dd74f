"""What the device scripts (``scripts/gpu/skyrl04_train.py``, ``areal_actor.py``,
``cross_framework.py``) share: the model and rollouts per framework, the spawn backend of a device,
and the one-line JSON summary (tests and device scripts only).

A summary counts, per replay mode, the router rows whose dispatched top-k differed from the routes
that had to be replayed (the runner's own router-call check against ``r3bridge.shard``'s targets)
and the disagreements the dispatch records keyed by (sample, token) show against the same routes
(``testlab.dispatch_records.compare_dispatch``): both must be zero, with rows checked.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional, Sequence

__all__ = ["backend_of", "skyrl_spec", "skyrl_rollouts", "areal_rollout", "dispatch_disagreements", "emit", "error_text"]

PERMUTE = [5, 1, 0, 4, 2, 7, 3, 6]  # the SkyRL update sees the samples in another order


def backend_of(device: str) -> str:
    """``spawn_layouts``' backend: NCCL with one GPU per rank, or gloo with the CPU shim."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, not {device!r}")
    return "nccl" if device == "cuda" else "gloo"


def skyrl_spec(layer_spec: str) -> Any:
    """The SkyRL model: 4 layers (layer 0 dense), 8 experts top-2, SkyRL's THD packing with its
    megatron settings (alltoall, ``variable_seq_lengths``), full recompute. ``"te"``: TE attention
    takes the packed sequences (bf16, sizes TE's kernels accept); ``"local"``: megatron's local
    attention refuses packed input, so the layers are MoE-only (``attention='identity'``), fp32."""
    import torch

    from r3bridge.testing.harness.models import ModelSpec

    common = dict(
        num_layers=4,
        moe_layer_freq=[0, 1, 1, 1],
        num_moe_experts=8,
        moe_router_topk=2,
        recompute="full",
        moe_token_dispatcher_type="alltoall",
    )
    if layer_spec == "te":
        return ModelSpec(
            hidden_size=64,
            ffn_hidden_size=128,
            num_attention_heads=4,
            layer_spec="te",
            attention="real",
            extra_config={
                "variable_seq_lengths": True,
                "bf16": True,
                "params_dtype": torch.bfloat16,
                "pipeline_dtype": torch.bfloat16,
            },
            **common,
        )
    if layer_spec == "local":
        return ModelSpec(attention="identity", extra_config={"variable_seq_lengths": True}, **common)
    raise ValueError(f"--layer-spec must be te or local, not {layer_spec!r}")


def skyrl_rollouts(steps: int, *, seed: int = 21) -> list:
    """One canonical rollout per step (8 samples, multi-turn engine calls), matching skyrl_spec."""
    from r3bridge.testing.kit.conformance import make_rollout

    return [
        make_rollout(seed + s, batch_size=8, num_experts=8, topk=2, num_layers=4, moe_layer_ids=[1, 2, 3])
        for s in range(steps)
    ]


def areal_rollout(seed: int = 11) -> Any:
    """The AReaL rollout (tests/adapters/test_areal_real.py's): 4 layers, layer 0 dense, 4 experts top-2."""
    from r3bridge.testing.kit.conformance import make_rollout

    return make_rollout(seed, batch_size=8, num_experts=4, topk=2, max_prompt=40)


def dispatch_disagreements(records: Any, expected: Any, seq_lens: Sequence[int], name: str) -> tuple[list[str], int]:
    """``records`` (one step's merged DispatchRecords) against ``expected`` (the routes that step
    had to replay): (errors, compared routed (sample, token, layer) entries)."""
    from testlab.dispatch_records import compare_dispatch

    res = compare_dispatch({name: records}, expected, list(seq_lens))
    return list(res.errors), int(res.compared)


def emit(out_dir: Optional[str], name: str, summary: dict) -> None:
    """Print ``summary`` as one JSON line and write it to ``<out_dir>/<name>.json``."""
    summary = {
        "script": name,
        "python": sys.version.split()[0],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **summary,
    }
    line = json.dumps(summary, sort_keys=True, default=str)
    print(line, flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            f.write(line + "\n")


def error_text(e: BaseException, *, head: int = 8000, tail: int = 3000) -> str:
    """A failed run's error for its JSON summary: the start (where a rank's chained traceback puts
    the root cause) and the end (the outermost error). Cutting the start off hid the cause of
    AReaL's first GPU failure behind 4000 characters of AReaL's model repr (2026-11-26)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= head + tail else f"{text[:head]}\n[... {len(text) - head - tail} characters ...]\n{text[-tail:]}"
