"""A verl 0.9.1 rollout backend on r3bridge's HF transformers engine (tests only).

vLLM and SGLang cannot run on the CPU harness (nor on the device machines: vllm pins another
torch); :class:`r3bridge.demo.hf_engine.HFEngine` samples with transformers and reports routes
exactly as vLLM does (``[prompt + generated - 1, num_hidden_layers, topk]`` uint8, dense layers
zero). This module serves it to verl's agent loop through verl's own extension points, under the
rollout name :data:`NAME` (``actor_rollout_ref.rollout.name=hf_r3``):

* ``RolloutReplicaRegistry.register(NAME, loader)`` (``verl/workers/rollout/replica.py:312``):
  :class:`HFReplica`, which starts one :class:`HFServer` Ray actor per replica;
* ``_ROLLOUT_REGISTRY[(NAME, "async")]`` (``verl/workers/rollout/base.py:89``, the lookup
  ``get_rollout_class`` does in the hybrid worker): :class:`HFServerAdapter`, the worker-side half.

Both are verl's registries (a dict verl itself reads by name), filled by :func:`register`; no verl
class is changed.

:meth:`HFServer.generate` answers as ``vLLMHttpServer.generate`` does
(``vllm_async_server.py:558-758``): ``TokenOutput(token_ids, log_probs, routed_experts,
stop_reason, extra_fields={"global_steps": int})``, ``routed_experts`` the engine's numpy array
unchanged (verl passes vLLM's through, ``:715``) and only when
``enable_rollout_routing_replay`` is on. Every call is also appended to a log
(``R3E2E_LOG_DIR``, one ``.pt`` file per call) so the test can check the trainer's router calls
against the routes this server returned.

Weights: the trainer's harness model (megatron local spec, MoE-only layers with an identity
attention: megatron's local attention refuses packed THD input) is not the HF model's
architecture, and mbridge 0.15.1 cannot export the local spec's SequentialMLP names nor
dense-first Qwen3-MoE layers (``mbridge/models/qwen2moe.py:104``). So weight sync is a
**documented lag**: :meth:`HFServerAdapter.update_weights` drains verl's weight generator without
loading it (the count is logged) and the engine samples with its initial seeded weights for the
whole job (a fixed behaviour policy). R3 replays whatever routes the engine reports, so the route
path under test is the same; the log-prob mismatch metrics measure two different models here.
Sleep / wake / KV-cache calls are no-ops: there is no device memory to release.
"""
from __future__ import annotations

import logging
import os
import time
import zlib
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger("testlab.verl_hf_rollout")

NAME = "hf_r3"
LOG_DIR_ENV = "R3E2E_LOG_DIR"
SEED_ENV = "R3E2E_ENGINE_SEED"
DTYPE_ENV = "R3E2E_ENGINE_DTYPE"


def register() -> None:
    """Fill verl's two rollout registries with this backend (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"


def _load_replica() -> type:
    return HFReplica


def _model_dir(model_config: Any) -> str:
    path = getattr(model_config, "local_path", None) or getattr(model_config, "path", None)
    if path is None and isinstance(model_config, dict):
        path = model_config.get("local_path") or model_config.get("path")
    return str(path)


class HFServer:
    """One rollout server (a Ray actor, as ``vLLMHttpServer``): token-in, token-out generation."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: Any, replica_rank: int = 0, **_: Any) -> None:
        from transformers import AutoConfig

        from r3bridge.demo.hf_engine import HFEngine, build_hf_model

        self.config = config
        self.rollout_mode = rollout_mode
        self.replica_rank = int(replica_rank)
        self.global_steps = 0
        path = _model_dir(model_config)
        hf_cfg = AutoConfig.from_pretrained(path)
        hf_cfg._attn_implementation = "sdpa"
        torch.set_num_threads(1)
        # bf16 as production engines serve: prefill and decode round differently, so a later
        # turn's re-prefill routes some earlier tokens differently (what first-seen is for)
        dtype = getattr(torch, os.environ.get(DTYPE_ENV, "bfloat16"))
        self.engine = HFEngine(build_hf_model(hf_cfg, seed=int(os.environ.get(SEED_ENV, "1234")), dtype=dtype),
                               pad_token_id=int(hf_cfg.pad_token_id or 0))
        self.return_routes = bool(getattr(config, "enable_rollout_routing_replay", False))
        self.calls = 0
        self.seen: dict[int, int] = {}
        self.log_dir = os.environ.get(LOG_DIR_ENV)

    # -------------------------------------------------------------------------- generation
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict] = None,
                       priority: int = 0, **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise NotImplementedError("the HF test backend serves text only")
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        cfg = self.config
        room = int(cfg.max_model_len or (cfg.prompt_length + cfg.response_length)) - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate")
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if max_tokens is None:     # as vLLMHttpServer: response_length, capped by the total budget
            max_tokens = min(cfg.response_length, cfg.prompt_length + cfg.response_length - len(prompt_ids))
        max_tokens = max(1, min(int(max_tokens), room))
        temperature = float(params.get("temperature", 1.0)) or 1.0
        stop = [int(t) for t in (params.get("stop_token_ids") or [])]
        eos = stop[0] if stop else None
        # deterministic across runs (request ids are fresh uuids): the n-th request of a prompt
        # (GRPO's n samples of it) gets the same seed in every run, and siblings differ
        key = zlib.crc32(np.asarray(prompt_ids, dtype=np.int64).tobytes())
        self.seen[key] = self.seen.get(key, 0) + 1
        seed = (key + 7919 * self.seen[key]) & 0x7FFFFFFF
        self.calls += 1
        done = self.engine.generate([prompt_ids], max_new_tokens=max_tokens, seed=seed, temperature=temperature,
                                    eos_token_id=eos)[0]
        routes = done.routed_experts if self.return_routes else None
        self._log(request_id, done)
        return TokenOutput(token_ids=list(done.output_ids),
                           log_probs=list(done.logprobs) if params.get("logprobs") else None,
                           routed_experts=routes, stop_reason="completed",
                           extra_fields={"global_steps": int(self.global_steps)})

    def _log(self, request_id: str, done: Any) -> None:
        if not self.log_dir:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        name = f"call_{self.replica_rank}_{time.monotonic_ns()}_{self.calls}.pt"
        torch.save({"request_id": request_id, "global_steps": int(self.global_steps),
                    "prompt_ids": done.prompt_ids, "output_ids": done.output_ids,
                    "routed_experts": torch.from_numpy(np.asarray(done.routed_experts).astype(np.int16))},
                   os.path.join(self.log_dir, name))

    # -------------------------------------------------------------------------- lifecycle (no-ops)
    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def get_server_address(self) -> tuple[str, int]:
        return "127.0.0.1", 0


def _replica_base() -> type:
    from verl.workers.rollout.replica import RolloutReplica
    return RolloutReplica


class HFReplica(_replica_base()):  # type: ignore[misc]
    """verl's ``RolloutReplica`` for :class:`HFServer`: one server actor, no GPUs of its own."""

    async def launch_servers(self) -> None:
        import ray

        server_cls = ray.remote(HFServer)
        kind = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else "rollout"
        server = server_cls.options(name=f"hf_r3_server_{kind}_{self.replica_rank}{self.name_suffix}",
                                    num_cpus=0, max_concurrency=self.max_concurrency).remote(
            config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        host, port = await server.get_server_address.remote()
        self._server_address = f"{host}:{port}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


def _base_rollout() -> type:
    from verl.workers.rollout.base import BaseRollout
    return BaseRollout


class HFServerAdapter(_base_rollout()):  # type: ignore[misc]
    """The hybrid worker's half (``get_rollout_class``): weights arrive here from the trainer."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        self.syncs = 0
        self.sleep_level = 0

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Documented lag (module doc): the trainer's weights are not loaded into the engine.
        The generator is not iterated either: mbridge 0.15.1 cannot export the harness model."""
        self.syncs += 1
        logger.info("hf_r3: weight sync %d from the trainer not loaded (documented lag)", self.syncs)


__all__ = ["NAME", "LOG_DIR_ENV", "register", "HFServer", "HFReplica", "HFServerAdapter"]
