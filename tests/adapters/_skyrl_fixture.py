"""SkyRL's fixture for r3bridge.testing.kit.conformance: a canonical rollout pushed through SkyRL's
own code (generator-side first-seen accumulation, ``convert_prompts_responses_to_batch_tensors``,
``TrainingInputBatch``, the worker's micro-batch dicts, ``MegatronModelWrapper``)."""
from __future__ import annotations

import base64
import functools
import io
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import numpy as np
import pytest
import torch

from r3bridge.adapters.skyrl import SkyRLCodec, SkyRLReplay, model_wrapper_class
from r3bridge.adapters.skyrl._compat import import_skyrl
from r3bridge.adapters.skyrl.codec import MASK_KEY, ROUTES_KEY, training_batch_fields
from r3bridge.adapters.skyrl.id_field import sample_id_field as record_ids_field
from r3bridge.adapters.skyrl.rollout import merge_first_seen
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import ReplayConfig
from r3bridge.engines.decoders import decode_vllm_routes
from r3bridge.errors import RouteShapeError
from r3bridge.hf import ModelInfo
from r3bridge.testing.kit.conformance import TWO_RANK, CanonicalRollout
from r3bridge.testing.kit.suite import AdapterFixtures

__all__ = ["wire", "generator_routes", "training_batch", "codec", "SkyRLRunner", "SkyRLFixtures", "make_router_padding_mask"]


def make_router_padding_mask(attention_mask: torch.Tensor, captured: Sequence[int]) -> torch.Tensor:
    """SkyRL main's ``router_padding_mask`` for left-padded rows: True except the first
    ``captured[i]`` real tokens of row ``i`` (what ``skyrl.train.dataset.preprocess.
    make_router_padding_mask`` computes; here because SkyRL 0.3.0 lacks it: the batches of a
    SkyRL-main job are built with it)."""
    attn = torch.as_tensor(attention_mask).bool()
    lens = attn.sum(1)
    cap = torch.as_tensor(list(captured), dtype=torch.long)
    if cap.shape != lens.shape or bool((cap < 0).any()) or bool((cap > lens).any()):
        raise RouteShapeError(f"captured route lengths {cap.tolist()} do not fit sequence lengths {lens.tolist()}")
    start = attn.shape[1] - lens
    pos = torch.arange(attn.shape[1])[None, :]
    return ~((pos >= start[:, None]) & (pos < (start + cap)[:, None]))


def wire(arr: np.ndarray, transport: str) -> Any:
    """One engine call's routes as SkyRL receives them."""
    if transport == "json":           # SkyRL 0.3.0 /skyrl/v1/generate: routed_experts.tolist()
        return arr.tolist()
    if transport == "npy_b64":        # vLLM OpenAI serving / SkyRL main: base64 of np.save bytes
        buf = io.BytesIO()
        np.save(buf, arr)
        return base64.b64encode(buf.getvalue()).decode("ascii")
    if transport == "ndarray":        # in-process vLLM CompletionOutput.routed_experts (read-only)
        a = arr.copy()
        a.setflags(write=False)
        return SimpleNamespace(routed_experts=a)
    raise ValueError(transport)


def generator_routes(rollout: CanonicalRollout, *, first_seen: bool = True, transport: str = "json") -> list:
    """Per sample, the ``rollout_expert_indices`` list SkyRL's generator ends up with: every call's
    payload decoded and accumulated first-seen (r3bridge's FirstSeenRoutesMixin) or overwritten by
    the latest call (SkyRL 0.3.0)."""
    out = []
    for calls in rollout.calls:
        acc = None
        for c in calls:
            rows = decode_vllm_routes(wire(c, transport)).tolist()
            acc = merge_first_seen(acc, rows) if first_seen else rows
        out.append(acc)
    return out


def training_batch(rollout: CanonicalRollout, *, fmt: str = "0.3.0", first_seen: bool = True,
                   transport: str = "json"):
    """The ``TrainingInputBatch`` SkyRL's trainer builds (``convert_to_training_input``), in SkyRL
    0.3.0's format (zero rows, no mask) or SkyRL main's (dummy rows ``0..K-1`` + mask)."""
    pre = import_skyrl("skyrl.train.dataset.preprocess")
    tb = import_skyrl("skyrl.backends.skyrl_train.training_batch")
    prompts = [t[:p] for t, p in zip(rollout.tokens, rollout.prompt_lens)]
    responses = [t[p:] for t, p in zip(rollout.tokens, rollout.prompt_lens)]
    routes = generator_routes(rollout, first_seen=first_seen, transport=transport)
    tok = SimpleNamespace(pad_token_id=0)     # convert_* only reads pad_token_id
    seqs, attn, action, rewards, loss_masks, logprobs, rei = pre.convert_prompts_responses_to_batch_tensors(
        tok, prompts, responses, [[0.0] * len(r) for r in responses], [[1] * len(r) for r in responses],
        None, routes)
    data = {"sequences": seqs, "attention_mask": attn, "response_mask": action, "rewards": rewards,
            "loss_mask": loss_masks, ROUTES_KEY: rei}
    if fmt == "main":
        captured = [min(len(r), len(t)) for r, t in zip(routes, rollout.tokens)]
        mask = make_router_padding_mask(attn, captured)
        rei = rei.clone()
        rei[mask] = torch.arange(rollout.topk, dtype=rei.dtype)
        data[ROUTES_KEY] = rei
        data[MASK_KEY] = mask
    batch = tb.TrainingInputBatch(data)
    batch.metadata = {"uids": [str(i) for i in range(len(prompts))]}
    return batch


def codec(rollout: CanonicalRollout) -> SkyRLCodec:
    return SkyRLCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                      num_hidden_layers=rollout.num_layers)


class SkyRLRunner:
    """:class:`r3bridge.testing.kit.conformance.MegatronRunner` over SkyRL's real ``MegatronModelWrapper``
    (``remove_microbatch_padding`` True: THD, False: BSHD) on harness chunks."""

    def __init__(self, rollout: Optional[CanonicalRollout] = None, *, remove_microbatch_padding: bool = True,
                 **options: Any) -> None:
        self.thd = remove_microbatch_padding
        self.options = options              # other r3bridge options (ReplayConfig fields)
        self.recorded: Optional[ReplayBatch] = None
        self._batch = None

    def attach(self, ctx, chunks, mode):
        cfgmod = import_skyrl("skyrl.train.config")
        tc = cfgmod.TrainerConfig()
        tc.remove_microbatch_padding = self.thd
        if self.thd:
            for c in chunks:   # SkyRL's THD path passes position_ids=None (RoPE models); the harness GPT
                emb = getattr(c, "embedding", None)   # uses learned absolute positions: switch them off
                if emb is not None:
                    emb.add_position_embedding = False
        cfg = chunks[0].config
        if ctx.vpp:   # what a SkyRL job's megatron config sets for the interleaved schedule
            cfg.microbatch_group_size_per_vp_stage = ctx.pp
        self.num_layers = cfg.num_layers
        self.moe = [i for i in range(cfg.num_layers)
                    if (cfg.moe_layer_freq[i] if isinstance(cfg.moe_layer_freq, list) else i % cfg.moe_layer_freq == 0)]
        rep = SkyRLReplay(chunks, ReplayConfig(replay_mode=mode, **self.options),
                          ModelInfo(num_experts=cfg.num_moe_experts, moe_layer_ids=self.moe, num_layers=cfg.num_layers))
        w = model_wrapper_class()(config=tc, actor_module=chunks, r3_replay=rep)
        w.replayer = rep.replayer
        return w

    def micro_batches(self, rollout, groups, *, key):
        if self._batch is None:
            self._batch = training_batch(rollout)
        b = self._batch
        mbs = []
        s = b["sequences"].shape[1]
        for g in groups:
            idx = torch.tensor(list(g))
            attn = b["attention_mask"][idx]
            pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
            d = {"sequences": b["sequences"][idx], "attention_mask": attn, "position_ids": pos,
                 "num_actions": 4, "sub_seq_lengths": None}
            if key is None:                                            # R2 record: PolicyWorkerMixin's ids
                d[ROUTES_KEY] = record_ids_field(list(g), s)
            elif key == "rollout":
                d[ROUTES_KEY] = b[ROUTES_KEY][idx].to(torch.int32)     # the worker's .to(torch.int32)
            elif key == "recorded":
                f = training_batch_fields(self.recorded, b["attention_mask"], num_hidden_layers=self.num_layers)
                d[ROUTES_KEY] = f[ROUTES_KEY][idx].to(torch.int32)
            mbs.append(d)
        assert all(m["sequences"].shape[1] == s for m in mbs)
        return mbs

    def run(self, w, mbs, *, phase):
        packing = []

        def note(module, args, kwargs):
            psp = kwargs.get("packed_seq_params")
            k = len([p for p in packing if p["chunk"] is module])
            mb = mbs[k] if k < len(mbs) else None
            lens = mb["attention_mask"].sum(-1).tolist() if mb is not None else []
            if psp is not None:
                packing.append(dict(chunk=module, seq_lens=lens, format="thd", cu_seqlens_padded=psp.cu_seqlens_q_padded))
            else:
                packing.append(dict(chunk=module, seq_lens=lens, format="bshd", seq_length=int(args[1].shape[1])))
        hs = [c.register_forward_pre_hook(note, with_kwargs=True) for c in w.actor_module[:1]]
        try:
            if phase == "compute_log_prob":
                w.eval()
                with torch.no_grad():
                    lp = w.forward(mbs, seq_len=mbs[0]["sequences"].shape[1], micro_batch_size=mbs[0]["sequences"].shape[0])
            else:
                # forward-only replay of the update's routes (SkyRL's loss-only path needs a loss config;
                # the routes and micro-batch handling are those of forward_backward_mini_batch)
                from r3bridge.config import Phase
                base = type(w).__mro__[1]                     # SkyRL's MegatronModelWrapper
                s, b = mbs[0]["sequences"].shape[1], mbs[0]["sequences"].shape[0]
                w.eval()
                with torch.no_grad():
                    lp = w.r3.run_micro_batches(Phase.UPDATE, mbs, forward_only=True,
                                                call=lambda m: base.forward(w, m, s, b))
        finally:
            for h in hs:
                h.remove()
        pk = [{k: v for k, v in p.items() if k != "chunk"} for p in packing]
        n = sum(m["sequences"].shape[0] for m in mbs)
        per_sample = list(lp) if lp.dim() == 2 and lp.shape[0] == n else []     # last pipeline stage only
        # what forward_backward_mini_batch adds to the metrics SkyRL logs (one micro-batch's dict)
        logged = w.r3.add_metrics([{}])[0] if phase == "update" else {}
        return {"logprobs": per_sample, "metrics": dict(w.r3.metrics), "recorded": w.r3.recorded, "packing": pk,
                "framework_metrics": logged}

    def write_recorded(self, rollout, recorded):
        self.recorded = recorded


class SkyRLFixtures(AdapterFixtures):
    """SkyRL's objects for the conformance kit (:mod:`r3bridge.testing.kit.suite`): the codec, the
    ``TrainingInputBatch`` SkyRL's trainer builds, the runner over its ``MegatronModelWrapper``
    (THD unless ``remove_microbatch_padding = False``); checks 4-5 on the 2-rank layouts."""

    remove_microbatch_padding = True

    @pytest.fixture
    def codec(self, rollout):
        return codec(rollout)

    @pytest.fixture
    def native_batch(self, rollout):
        return training_batch(rollout)

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_runner(cls):
        return functools.partial(SkyRLRunner, remove_microbatch_padding=cls.remove_microbatch_padding)

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls):
        return TWO_RANK

    @pytest.fixture(scope="class")
    @classmethod
    def min_coverage(cls):
        return 0.5          # SkyRL's checks 4-5 have asserted coverage > 0.5 since their first version
