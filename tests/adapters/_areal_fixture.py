"""AReaL's fixture for r3bridge.testing.kit.conformance: a canonical rollout pushed through AReaL's own
data utilities (``concat_padded_tensors``, ``split_and_unpad_tensor``,
``split_padded_tensor_dict_into_mb_list``, ``pack_tensor_dict``, ``pad_mb_list``,
``packed_context_parallel_forward``) and r3bridge's AReaL mixins.

Stand-ins, because AReaL 1.0.4's ``areal.infra`` (``RemoteInfEngine``, ``SGLangBackend``'s module)
and ``MegatronEngine`` cannot be imported without the OpenAI agent stack / mbridge:

* :class:`FakeSGLang` - the SGLang server: exact ``/generate`` JSON (``meta_info`` with base64
  int32 ``routed_experts``, ``prompt_tokens``, ``completion_tokens``, ``finish_reason``);
* :class:`StandInInfEngine` - AReaL 1.0.4's ``RemoteInfEngine.agenerate`` resubmit loop (parse
  each attempt, ``np.concatenate`` the routes) and ``SGLangBackend.parse_generation_response``'s
  decode, line for line;
* :class:`StandInMegatronEngine` - ``MegatronEngine._prepare_mb_list`` and
  ``forward_backward_batch`` for text models, calling AReaL's real utilities in the same order.
"""
from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch

from r3bridge.adapters.areal.codec import ROUTES_KEY, ArealCodec
from r3bridge.adapters.areal.hooks import (
    MB_KEY,
    MegatronEngineMixin,
    PPOActorMixin,
    SGLangEngineMixin,
    WorkflowMixin,
)
from r3bridge.adapters.areal.rollout import routes_from_responses
from r3bridge.adapters.areal.sequence_last import sequence_last_routes as trajectory_tensor
from r3bridge.config import ReplayConfig
from r3bridge.hf import ModelInfo
from r3bridge.testing.kit.conformance import TWO_RANK, CanonicalRollout
from r3bridge.testing.kit.suite import AdapterFixtures
from testlab.areal_env import import_areal
from testlab.areal_rollout import FakeSGLang  # the same fake server the real-engine test uses

__all__ = ["FakeSGLang", "StandInInfEngine", "trajectories", "batch", "model_info", "ArealRunner", "ArealFixtures"]

def _data():
    return import_areal("areal.utils.data")


def model_info(r: CanonicalRollout) -> ModelInfo:
    return ModelInfo(num_experts=r.num_experts, moe_layer_ids=r.moe_layer_ids, num_layers=r.num_layers, topk=r.topk)


class _Backend:
    """``SGLangBackend.build_generation_request`` / ``parse_generation_response`` of AReaL 1.0.4."""

    def build_generation_request(self, req, with_lora=False, version=0):
        payload = {"input_ids": req.input_ids.copy(), "sampling_params": {}, "return_logprob": True, "stream": False}
        if req.metadata.get("return_routed_experts", False):
            payload["return_routed_experts"] = True
        return SimpleNamespace(endpoint="/generate", payload=payload, method="POST")

    def parse_generation_response(self, response):
        io = import_areal("areal.api.io_struct")
        meta_info = response["meta_info"]
        stop_reason = meta_info["finish_reason"]["type"]
        routed_experts = meta_info.get("routed_experts", None)
        if routed_experts is not None:
            num_sgl_token = meta_info["prompt_tokens"] + meta_info["completion_tokens"] - 1
            routed_experts = np.frombuffer(base64.b64decode(routed_experts.encode("utf-8")),
                                           dtype=np.int32).reshape(num_sgl_token, -1)
        return io.HttpGenerationResult(output_tokens=[x[1] for x in meta_info["output_token_logprobs"]],
                                       output_logprobs=[x[0] for x in meta_info["output_token_logprobs"]],
                                       stop_reason=stop_reason, routed_experts=routed_experts)


class StandInInfEngine:
    """``RemoteInfEngine`` reduced to ``agenerate``'s resubmit loop (AReaL 1.0.4, its bug included)."""

    def __init__(self, server: FakeSGLang) -> None:
        self.server, self.backend = server, _Backend()

    async def agenerate(self, req):
        io = import_areal("areal.api.io_struct")
        req = SimpleNamespace(input_ids=list(req.input_ids), metadata={"return_routed_experts": True})
        acc_tokens, acc_routes, stop_reason = [], [], None
        while stop_reason not in ("stop", "tool_calls", "length"):
            http = self.backend.build_generation_request(req)
            res = self.backend.parse_generation_response(self.server.generate(http.payload))
            stop_reason = res.stop_reason
            acc_tokens.extend(res.output_tokens)
            if res.routed_experts is not None:
                acc_routes.append(res.routed_experts)
            req.input_ids += res.output_tokens
        return io.ModelResponse(input_tokens=req.input_ids[: len(req.input_ids) - len(acc_tokens)],
                                output_tokens=acc_tokens, stop_reason=stop_reason,
                                routed_experts=np.concatenate(acc_routes) if acc_routes else None)


class _RemoteSGLangLike:
    """The shape of ``RemoteSGLangEngine``: composes a ``RemoteInfEngine`` as ``self._engine``."""

    def __init__(self, inner: StandInInfEngine) -> None:
        self._engine = inner

    async def agenerate(self, req):
        return await self._engine.agenerate(req)


class R3SGLang(SGLangEngineMixin, _RemoteSGLangLike):
    pass


class _Episode:
    """A parent-concat workflow: one request per turn (each prompt = the previous context + new
    tokens), trajectory = the rollout's final tokens. Same shape as AReaL's RLVR / multi-turn
    workflows' ``arun_episode``."""

    def __init__(self, rollout: CanonicalRollout) -> None:
        self.r = rollout

    async def arun_episode(self, engine, data):
        i = data["i"]
        r = self.r
        for t, pl in enumerate(r.call_prompt_lens[i]):
            if t and pl == len(r.call_tokens[i][t - 1]):
                continue                     # a resubmit happens inside agenerate
            await engine.agenerate(SimpleNamespace(input_ids=r.call_tokens[i][t][:pl]))
        seq = r.tokens[i]
        return {"input_ids": torch.tensor([seq], dtype=torch.int32),
                "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
                "loss_mask": torch.tensor([[0] * r.prompt_lens[i] + [1] * (len(seq) - r.prompt_lens[i])], dtype=torch.int32),
                "rewards": torch.zeros(1)}


class _R3Episode(WorkflowMixin, _Episode):
    pass


class _PlainRecorder:
    """AReaL without r3bridge's dedupe: keeps each ModelResponse as AReaL built it."""

    def __init__(self, engine, responses) -> None:
        self._inner, self._responses = engine, responses

    async def agenerate(self, req):
        resp = await self._inner.agenerate(req)
        self._responses.append(resp)
        return resp


def trajectories(rollout: CanonicalRollout, *, dedupe: bool = True) -> list[dict]:
    """One AReaL trajectory dict per sample through r3bridge's WorkflowMixin (``dedupe=False``:
    the same trajectory field built from AReaL 1.0.4's own concatenated ``routed_experts``)."""

    info = model_info(rollout)
    out = []
    for i in range(rollout.batch_size):
        inner = _RemoteSGLangLike(StandInInfEngine(FakeSGLang(rollout, i)))
        if dedupe:
            wf = _R3Episode(rollout)
            wf.r3_model = info
            out.append(asyncio.run(wf.arun_episode(inner, {"i": i})))
        else:
            responses: list = []
            traj = asyncio.run(_Episode(rollout).arun_episode(_PlainRecorder(inner, responses), {"i": i}))
            rb = routes_from_responses(responses, rollout.tokens[i], num_experts=info.num_experts,
                                       num_layers=info.num_layers, topk=info.topk,
                                       moe_layer_ids=info.moe_layer_ids).routes
            traj[ROUTES_KEY] = trajectory_tensor(rb, [len(rollout.tokens[i])])
            out.append(traj)
    return out


def batch(rollout: CanonicalRollout, **kw) -> dict:
    """AReaL's batched dict (``concat_padded_tensors`` of the trajectory dicts)."""
    return _data().concat_padded_tensors(trajectories(rollout, **kw))


# ---------------------------------------------------------------------------------- Megatron level
class StandInMegatronEngine:
    """``MegatronEngine`` reduced to the two methods r3bridge hooks, text models only, with AReaL
    1.0.4's own utilities in its own order."""

    def __init__(self, chunks, ctx) -> None:
        self.model = list(chunks)
        self.ctx = ctx
        self.enable_tree_training = self.is_vision_model = self.use_padded_seq = False
        self.outputs: list = []

    def _prepare_mb_list(self, input_: dict):
        d = _data()
        cli = import_areal("areal.api.cli_args")
        input_ = d.amend_position_ids(input_)
        pp, cp, tp = self.ctx.pp, self.ctx.cp, self.ctx.tp
        spec = cli.MicroBatchSpec.new(cli.MicroBatchSpec(n_mbs=self.n_mbs), n_mbs=max(2 * pp if pp > 1 else 1, self.n_mbs),
                                      n_mbs_divisor=pp)
        mb_list = d.split_padded_tensor_dict_into_mb_list(input_, spec, group=None)
        mb_list.mbs = [d.pack_tensor_dict(mb) for mb in mb_list.mbs]
        align = tp * cp * 2 if cp > 1 else tp
        mb_list = d.pad_mb_list(mb_list, pad_value=0.0, pad_to_maximum=False, seq_align_to=align)
        for i, mb in enumerate(mb_list.mbs):
            mb_list.mbs[i] = dict(**mb)
        for i, mb in enumerate(mb_list.padded_mbs):
            mb_list.padded_mbs[i] = dict(**mb)
        return mb_list

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only=False):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        pcp = import_areal("areal.engine.megatron_utils.packed_context_parallel")
        d = _data()

        def forward_step(batch_iter, model):
            item = next(batch_iter)
            out = pcp.packed_context_parallel_forward(model, item.padded_mb, gather_cp_output=True)
            if getattr(model, "post_process", False):
                out = d.unpad_logits(out, padding_length=item.padding_length, cu_seqlens=item.padded_mb["cu_seqlens"],
                                     old_cu_seqlens=item.old_cu_seqlens)

            def loss(o):
                self.outputs.append(o.detach() if isinstance(o, torch.Tensor) else o)
                return torch.zeros((), requires_grad=not forward_only), {}
            return out, loss

        cfg = self.model[0].config
        cfg.finalize_model_grads_func = None
        cfg.grad_scale_func = None
        if len(self.model) > 1:
            cfg.microbatch_group_size_per_vp_stage = self.ctx.pp
        it = [iter(mb_list) for _ in self.model] if len(self.model) > 1 else iter(mb_list)
        with torch.no_grad() if forward_only else torch.enable_grad():
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it,
                                        model=self.model if len(self.model) > 1 else self.model[0],
                                        num_microbatches=len(mb_list), seq_length=mb_list.max_seqlen,
                                        micro_batch_size=1, forward_only=forward_only)


class R3StandInEngine(MegatronEngineMixin, StandInMegatronEngine):
    pass


class _Actor:
    """``PPOActor``'s two entry points as the trainer calls them (batched through AReaL's
    ``batched_call``), with the engine calls reduced to one forward pass."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def compute_logp(self, data):
        return _data().batched_call(self._compute_logp, data)

    def _compute_logp(self, data):
        self.engine.outputs = []
        mb_list = self.engine._prepare_mb_list(dict(data))
        self.engine.forward_backward_batch(mb_list, None, forward_only=True)
        return None

    def ppo_update(self, data):
        return _data().batched_call(self._ppo_update, data, unpack=False)

    def _ppo_update(self, data):
        self.engine.outputs = []
        mb_list = self.engine._prepare_mb_list(dict(data))
        self.engine.forward_backward_batch(mb_list, None, forward_only=True)   # the update's routes, no step


class R3Actor(PPOActorMixin, _Actor):
    pass


class ArealRunner:
    """:class:`r3bridge.testing.kit.conformance.MegatronRunner` for AReaL (stand-in engine, real utilities)."""

    def __init__(self, rollout: Optional[CanonicalRollout] = None, **options) -> None:
        self.trajs: Optional[list] = None         # built from the rollout ``micro_batches`` gets
        self.options = options                    # other r3bridge options (ReplayConfig fields)

    def attach(self, ctx, chunks, mode):
        for c in chunks:   # AReaL's models use RoPE; the harness GPT's learned absolute positions would get
            emb = getattr(c, "embedding", None)     # un-split position_ids under CP: switch them off
            if emb is not None:
                emb.add_position_embedding = False
        eng = R3StandInEngine(chunks, ctx)
        eng.r3_config = ReplayConfig(replay_mode=mode, **self.options)
        cfg = chunks[0].config
        moe = [i for i in range(cfg.num_layers)
               if (cfg.moe_layer_freq[i] if isinstance(cfg.moe_layer_freq, list) else i % cfg.moe_layer_freq == 0)]
        eng.r3_attach(ModelInfo(num_experts=cfg.num_moe_experts, moe_layer_ids=moe, num_layers=cfg.num_layers,
                                topk=cfg.moe_router_topk))
        eng.replayer = eng.r3.replayer
        return R3Actor(eng)

    def micro_batches(self, rollout, groups, *, key):
        if self.trajs is None:
            self.trajs = trajectories(rollout)
        return [self.trajs[i] for g in groups for i in g], [len(g) for g in groups], [i for g in groups for i in g]

    def run(self, actor, mbs, *, phase):
        trajs, sizes, order = mbs
        eng = actor.engine
        eng.n_mbs = len(sizes)
        packing = []

        def note(module, args, kwargs):
            psp = kwargs.get("packed_seq_params")
            cu = psp.cu_seqlens_q_padded
            k = len(packing)
            mb = self._mbl.padded_mbs[k][MB_KEY]
            packing.append(dict(seq_lens=list(mb.seq_lens), format="thd", cu_seqlens_padded=cu.cpu(),
                                samples=[order[g] for g in mb.sample_ids if g is not None]))
        orig_prepare = eng._prepare_mb_list

        def prepare(inp):
            self._mbl = orig_prepare(inp)
            return self._mbl
        eng._prepare_mb_list = prepare            # test-side capture of the micro-batch list
        h = eng.model[0].register_forward_pre_hook(note, with_kwargs=True)
        try:
            if phase == "compute_log_prob":
                actor.compute_logp(trajs)
            else:
                actor.ppo_update(trajs)
        finally:
            h.remove()
            del eng._prepare_mb_list
        # what the mixin logged into AReaL's stats tracker for this phase (exported like AReaL does)
        st = import_areal("areal.utils.stats_tracker")
        logged = {k: v for k, v in st.export().items() if k.startswith("r3bridge/")}
        # per-sample logits of the last stage (AReaL's unpadded outputs, one per micro-batch in
        # schedule order), in the runner's sample order as the conformance check pairs them
        by_sample = {}
        if eng.outputs:
            assert len(eng.outputs) == len(self._mbl.mbs), (len(eng.outputs), len(self._mbl.mbs))
            for mb, pmb, o in zip(self._mbl.mbs, self._mbl.padded_mbs, eng.outputs):
                cu = mb["cu_seqlens"].tolist()
                for j, g in enumerate(g for g in pmb[MB_KEY].sample_ids if g is not None):
                    by_sample[order[g]] = o[cu[j]:cu[j + 1]]
        logprobs = [by_sample[i] for i in order] if by_sample else []
        res = eng.r3.result
        return {"logprobs": logprobs, "metrics": dict(res.metrics), "recorded": res.recorded,
                "packing": packing, "framework_metrics": logged}

    def write_recorded(self, rollout, recorded):
        pass                                      # PPOActorMixin.compute_logp already wrote it back


class ArealFixtures(AdapterFixtures):
    """AReaL's objects for the conformance kit (:mod:`r3bridge.testing.kit.suite`): the codec, the
    batch AReaL's ``concat_padded_tensors`` builds from the workflow's trajectories, the runner;
    checks 4-5 on the 2-rank layouts."""

    @pytest.fixture
    def codec(self, rollout):
        return ArealCodec(model_info(rollout))

    @pytest.fixture
    def native_batch(self, rollout):
        return batch(rollout)

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_runner(cls):
        return ArealRunner

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls):
        return TWO_RANK
