"""vLLM as the evidence run's rollout engine, in-process and colocated with the trainer.

The same calls as verl's colocated vLLM (verl 0.9.1 pins vLLM 0.24.0), with the transport left
out because engine and trainer share one process here:

* the engine starts on dummy weights (``load_format="dummy"``: only ``config.json`` in the model
  folder, verl's default for colocated rollout) and takes the trainer's weights before the first
  rollout;
* every step, before sampling, :meth:`VLLMEngine.load_hf_state` runs verl's update path on the
  worker (``vllm_rollout/utils.py``: ``model.load_weights(named tensors)`` then
  ``process_weights_after_loading(model, model_config, device)`` once) through
  ``LLM.collective_rpc(callable)``. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in
  this process (``InprocClient`` + ``UniProcExecutor``), so the callable gets the worker itself and
  the tensors by reference: no ZMQ / CUDA-IPC buckets as verl needs between processes;
* prefix caching is off: after a weight update verl resets the prefix cache (``wake_up``); with
  it off no KV block computed under old weights, nor its routes, is ever reused;
* no sleep mode: the model is a few MB, so engine and trainer both stay resident (verl sleeps the
  engine to free its KV cache for training; that changes memory, not numerics);
* ``enforce_eager``: no torch.compile and no CUDA graphs, so ten engines start in seconds on
  one GPU. The kernels (attention, fused MoE, sampler) are the same ones;
* the KV cache is a fixed size (``kv_cache_memory_bytes``) instead of a fraction of the GPU found
  by profiling: engines of several arms start side by side on one GPU, and profiling would see
  the others' memory move.

Routes come back as vLLM returns them (``CompletionOutput.routed_experts``,
``[prompt + response - 1, num_hidden_layers, top_k]``) and reach the trainer only through
``ReplayBatch.from_vllm``. Anything missing or of the wrong shape raises :class:`EngineError`.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch

from r3bridge.demo.hf_engine import Completion
from r3bridge.errors import ReplayError
from r3bridge.hf import moe_layer_ids_from_hf_config, num_experts_from_hf_config, topk_from_hf_config

__all__ = ["EngineError", "VLLMEngine", "checkpoint_names"]


class EngineError(ReplayError, RuntimeError):
    """The rollout engine is missing, too old, or returned something the run cannot use."""


# what the run needs from vLLM; each was added in some 0.1x release (checked against 0.24.0)
_LLM_ARGS = ("enable_return_routed_experts", "kv_cache_memory_bytes", "skip_tokenizer_init")


def _import_vllm() -> Any:
    # must be set before vLLM builds its engine: the engine core in this process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # the run samples without top-k / top-p, so vLLM never uses the FlashInfer sampler; at the
    # variable's default vLLM 0.24.0 still imports flashinfer for it, which the device's wheel set
    # does not carry (docs/gpu.md, "Real vLLM on the device")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
    except ImportError as e:
        raise EngineError(f"--engine vllm needs vLLM (verl 0.9.1's pin: vllm==0.24.0) importable in this "
                          f"interpreter: {type(e).__name__}: {e}") from e
    params = inspect.signature(vllm.LLM.__init__).parameters
    missing = [a for a in _LLM_ARGS if a not in params]
    if missing or not hasattr(vllm.LLM, "collective_rpc"):
        raise EngineError(f"vLLM {getattr(vllm, '__version__', '?')} lacks what the run uses "
                          f"(LLM({', '.join(missing) or '...'}), LLM.collective_rpc); use vllm==0.24.0")
    return vllm


def checkpoint_names(hf_state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """transformers 5's in-memory Qwen3-MoE names -> the checkpoint names vLLM's loader maps:
    fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` become
    ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (what a Qwen3-MoE checkpoint holds)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out.append((f"{base}{e}.gate_proj.weight", gate[e].contiguous()))
                out.append((f"{base}{e}.up_proj.weight", up[e].contiguous()))
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out.append((f"{base}{e}.down_proj.weight", t[e].contiguous()))
        else:
            out.append((name, t))
    return out


def _load_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Runs on the vLLM worker (collective_rpc): verl's standard update, then the names of the
    model's parameters that no weight reached (must be none)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    runner = worker.model_runner
    model = runner.model
    loaded = set(model.load_weights(weights))
    process_weights_after_loading(model, runner.model_config, runner.device)
    return sorted(n for n, _ in model.named_parameters() if n not in loaded)


class VLLMEngine:
    """``vllm.LLM`` sampling token-id prompts; results as :class:`r3bridge.demo.hf_engine.Completion`."""

    def __init__(self, model_dir: str, hf_config: Any, *, seed: int, max_num_seqs: int, max_model_len: int,
                 kv_cache_bytes: int = 256 << 20, gpu_memory_utilization: float = 0.03) -> None:
        vllm = _import_vllm()
        self.version = str(getattr(vllm, "__version__", "?"))
        self.num_layers = int(hf_config.num_hidden_layers)
        self.moe_layer_ids = moe_layer_ids_from_hf_config(hf_config)
        self.num_experts = num_experts_from_hf_config(hf_config)
        self.topk = int(topk_from_hf_config(hf_config))
        self.llm = vllm.LLM(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", seed=seed,
            enable_return_routed_experts=True, enforce_eager=True, enable_prefix_caching=False,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_seqs * max_model_len, 2048), generation_config="vllm")

    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """The trainer's weights (HF names), as bf16, into the engine (verl's update path)."""
        weights = [(n, t.to(torch.bfloat16)) for n, t in checkpoint_names(hf_state)]
        missing = self.llm.collective_rpc(_load_on_worker, args=(weights,))[0]
        if missing:
            raise EngineError(f"vLLM weight update left {len(missing)} parameter(s) unloaded: {missing[:5]}")

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_id: int,
                 temperature: float = 1.0, seed: Optional[int] = None) -> list[Completion]:
        """One request per prompt, sampled from the engine's generator (seeded once, at
        construction, as a serving engine is). ``seed`` is taken for the common engine call and not
        used: per-request seeds make vLLM's sampler draw each request's noise in a Python loop
        (``topk_topp_sampler.random_sample``), a kernel per request and token."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens, logprobs=0,
                                detokenize=False, stop_token_ids=[eos_token_id])
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], params, use_tqdm=False)
        return [self._completion(i, list(map(int, p)), o.outputs[0], eos_token_id)
                for i, (p, o) in enumerate(zip(prompts, outs))]

    def _completion(self, i: int, prompt: list[int], out: Any, eos_token_id: int) -> Completion:
        tokens = [int(t) for t in out.token_ids]
        if out.finish_reason == "stop" and (not tokens or tokens[-1] != eos_token_id):
            # the reward and the routes' row count both assume the stop token is in the response
            raise EngineError(f"request {i}: vLLM stopped without returning the stop token {eos_token_id} "
                              f"(response {tokens})")
        routes = out.routed_experts
        if routes is None:
            raise EngineError(f"request {i}: vLLM returned no routed_experts (enable_return_routed_experts "
                              f"not honoured by vLLM {self.version})")
        routes = np.asarray(routes)
        want = (len(prompt) + len(tokens) - 1, self.num_layers, self.topk)
        if routes.shape != want:
            raise EngineError(f"request {i}: routed_experts shape {routes.shape}, expected {want} "
                              f"(prompt {len(prompt)} + response {len(tokens)} - 1 rows, layers, top-k)")
        if out.logprobs is None or len(out.logprobs) != len(tokens):
            raise EngineError(f"request {i}: {0 if out.logprobs is None else len(out.logprobs)} log-probs for "
                              f"{len(tokens)} sampled tokens")
        logprobs = [float(out.logprobs[t][tok].logprob) for t, tok in enumerate(tokens)]
        return Completion(prompt, tokens, routes, logprobs, str(out.finish_reason))
