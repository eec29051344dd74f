"""What every process of a CPU verl job needs, imported through ``actor_rollout_ref.model.external_lib``.

verl imports ``external_lib`` whenever it builds an ``HFModelConfig`` (``workers/config/model.py:149``),
which every worker does before it builds a model, and the agent loop / reward workers too. This
module then, in each process (idempotent):

* registers the HF rollout backend (:mod:`testlab.verl_hf_rollout`) in verl's rollout registries;
* applies the harness's CPU shims (:mod:`r3bridge.testing.harness.cpu_shim`, :mod:`testlab.verl_cpu`):
  no CUDA, no Transformer Engine (their reasons are in those modules);
* swaps mbridge's bridges for the TE-free harness bridges (:func:`testlab.mbridge_spec.te_free_bridges`,
  MoE-only layers: megatron's local attention refuses packed sequences) for the process's
  lifetime, each with :class:`DispatchProbeMixin` in front, which attaches observation hooks
  (:class:`ChunkProbe`) to every model the bridge builds;
* ``torch.cuda.set_device`` becomes a no-op: verl builds the rollout's device mesh on device type
  ``cuda`` (``engine_workers.py:662``, ``init_device_mesh(get_device_name(), ...)``) and torch's
  ``DeviceMesh`` then selects the local CUDA device, which a CPU build cannot
  (``module 'torch._C' has no attribute '_cuda_setDevice'``).

Observation only: a forward pre-hook on each model chunk reads the packed micro-batch (token ids
and ``packed_seq_params``, as verl's engine passes them), and a forward hook on each router reads
the expert ids it dispatched (its routing map) and the native top-k of its own logits
(``router.gating``: the router's own linear layer; Qwen3-MoE scores are a softmax, so the top-k
of the logits is the top-k of the scores). One record per router call is saved under
``R3E2E_LOG_DIR/dispatch/``: which engine (actor or reference, read from the engine that owns the
chunk), grad mode, layer, the packed sequences' tokens and lengths, the dispatched and native ids.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any

import torch

from testlab.verl_hf_rollout import LOG_DIR_ENV, register

_STACK = contextlib.ExitStack()
_STATE: dict[str, Any] = {"done": False}


class ChunkProbe:
    """Hooks on one model chunk: its current micro-batch, and one record per router call."""

    def __init__(self, chunk: torch.nn.Module, out_dir: str) -> None:
        from r3bridge.testing.harness.probe import find_routers

        self.chunk = chunk
        self.out_dir = out_dir
        self.role: str | None = None
        self.batch: dict[str, Any] | None = None
        chunk.register_forward_pre_hook(self._pre, with_kwargs=True)
        for ref in find_routers([chunk]):
            if not ref.mtp:
                ref.module.register_forward_hook(self._router_hook(ref.layer_id))

    def _pre(self, _module: Any, _args: Any, kwargs: dict) -> None:
        from testlab.verl_e2e_parallel import rank_info

        ids, psp = kwargs.get("input_ids"), kwargs.get("packed_seq_params")
        if ids is None or psp is None:
            raise AssertionError(f"verl's forward passed no input_ids / packed_seq_params (kwargs {sorted(kwargs)})")
        cu = psp.cu_seqlens_q.cpu().tolist()
        cu_pad = (psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q).cpu().tolist()
        padded = [b - a for a, b in zip(cu_pad[:-1], cu_pad[1:])]
        if ids.is_nested:
            # a later pipeline stage: verl hands over its nested, unpadded ids
            # (preprocess_thd_engine(pre_process=False) returns them unchanged)
            seqs = [t.tolist() for t in ids.unbind()]
            lens, exact = [len(t) for t in seqs], True
        else:
            flat = ids.reshape(-1).cpu()
            lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
            seqs = [flat[a:a + n].tolist() for a, n in zip(cu_pad[:-1], lens)]
            # verl 0.9.1 sets cu_seqlens_q to the padded offsets too: real lengths unknown here
            # when the packing pads (testlab.verl_e2e_parallel.resolve_lengths)
            exact = cu != cu_pad or self.config_alignment() == 1
        par = rank_info()
        par["sp"] = bool(getattr(self.chunk.config, "sequence_parallel", False))
        self.batch = {"seqs": seqs, "lens": lens, "padded": padded, "lens_exact": exact, "parallel": par}

    def config_alignment(self) -> int:
        from megatron.core import parallel_state as ps

        cp = ps.get_context_parallel_world_size()
        return ps.get_tensor_model_parallel_world_size() * cp * (2 if cp > 1 else 1)

    def _router_hook(self, layer_id: int) -> Any:
        def hook(module: torch.nn.Module, inp: Any, out: Any) -> None:
            _probs, routing_map = out
            k = int(module.topk)
            dispatched = routing_map.to(torch.int64).topk(k, dim=-1).indices.sort(dim=-1).values
            with torch.no_grad():
                logits = module.gating(inp[0]).reshape(-1, routing_map.shape[-1])
                native = logits.float().topk(k, dim=-1).indices.sort(dim=-1).values
            if self.role is None:
                self.role = _role_of(self.chunk)
            replay = getattr(module, "router_replay", None)
            rec = {"pid": os.getpid(), "time": time.monotonic_ns(), "role": self.role, "layer": layer_id,
                   "grad": torch.is_grad_enabled(), "batch": self.batch, "dispatched": dispatched.cpu(),
                   "native": native.cpu(), "hook": type(replay).__name__ if replay is not None else None}
            os.makedirs(self.out_dir, exist_ok=True)
            torch.save(rec, os.path.join(self.out_dir, f"{os.getpid()}_{rec['time']}_{layer_id}.pt"))
        return hook


def _role_of(chunk: torch.nn.Module) -> str:
    """``actor`` or ``ref``: the verl engine whose model holds ``chunk`` (the reference engine is
    built with ``engine_config.forward_only``)."""
    from verl.utils.megatron_utils import unwrap_model
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    for obj in gc.get_objects():
        if isinstance(obj, MegatronEngine) and any(unwrap_model(m) is chunk for m in (obj.module or [])):
            return "ref" if bool(getattr(obj.engine_config, "forward_only", False)) else "actor"
    return "unknown"


class DispatchProbeMixin:
    """In front of a harness bridge: hook every chunk of every model it builds (observation)."""

    def get_model(self, *args: Any, **kwargs: Any) -> Any:
        models = super().get_model(*args, **kwargs)  # type: ignore[misc]
        out_dir = os.environ.get(LOG_DIR_ENV)
        if out_dir:
            from verl.utils.megatron_utils import unwrap_model

            for m in models:
                ChunkProbe(unwrap_model(m), os.path.join(out_dir, "dispatch"))
        return models


def _no_set_device(device: Any) -> None:
    return None


def _probe_megatron_bridge() -> None:
    """verl's default model builder (``vanilla_mbridge=False``): Megatron-Bridge (GPU, Python 3.12).
    Its own registry (``MegatronModelBridge.register_bridge``, the last registration of an HF class
    wins) gets a Qwen3-MoE bridge whose providers carry a pre-wrap hook: the model chunks it builds
    are observed like mbridge's (:class:`ChunkProbe`); nothing else of the bridge changes."""
    try:
        from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
        from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge
        from megatron.core.models.gpt.gpt_model import GPTModel
        from transformers import Qwen3MoeForCausalLM
    except ImportError:
        return

    def observe(models: list) -> list:
        out_dir = os.environ.get(LOG_DIR_ENV)
        if out_dir:
            for m in models:
                ChunkProbe(m, os.path.join(out_dir, "dispatch"))
        return models

    @MegatronModelBridge.register_bridge(source=Qwen3MoeForCausalLM, target=GPTModel, model_type="qwen3_moe")
    class ProbedQwen3MoEBridge(Qwen3MoEBridge):
        def provider_bridge(self, hf_pretrained: Any) -> Any:
            provider = super().provider_bridge(hf_pretrained)
            provider.register_pre_wrap_hook(observe)
            return provider


def setup() -> None:
    if _STATE["done"]:
        return
    register()
    from mbridge.core import bridge as mb_bridge
    from mbridge.core.llm_bridge import LLMBridge

    if torch.cuda.is_available():
        # a GPU process: no shims, no substitution: mbridge's own (TE) bridges, observed, and
        # Megatron-Bridge's Qwen3-MoE bridge where it is installed (verl's default builder)
        bridges = {k: c for k, c in mb_bridge._MODEL_REGISTRY.items() if isinstance(c, type) and issubclass(c, LLMBridge)}
        _probe_megatron_bridge()
    else:
        from r3bridge.testing.harness import cpu_shim
        from testlab import verl_cpu
        from testlab.mbridge_spec import te_free_bridges

        cpu_shim.apply()
        torch.cuda.set_device = _no_set_device  # type: ignore[assignment]
        verl_cpu.apply()
        bridges = _STACK.enter_context(te_free_bridges(attention="identity"))
    for model_type, cls in bridges.items():
        mb_bridge._MODEL_REGISTRY[model_type] = type(f"Probed{cls.__name__}", (DispatchProbeMixin, cls), {})
    _STATE["done"] = True


setup()
