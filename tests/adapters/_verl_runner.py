"""verl 0.9.1's engine as a conformance :class:`r3bridge.testing.kit.conformance.MegatronRunner`
(checks 4 and 5) on CPU harness chunks.

The engine is the adapter's registered class ``R3BridgeMegatronEngine`` (verl's own
``MegatronEngineWithLMHead`` subclass) with only verl's schedule call and model-running
``forward_step`` body stood in for (:class:`HarnessVerl`): no verl model, bridge or TE exists here.
Everything of the adapter runs for real: ``forward_backward_batch`` (phase, R2 sample index,
metrics into ``output["metrics"]``, compute_log_prob's carried to the update, R2 routes returned in
``model_output["routed_experts"]``), the ``forward_step`` override and ``r3_install`` with verl's own
``preprocess_thd_engine`` packing. Of verl's code the stand-in calls its own ``prepare_micro_batches``
(fixed or dynamic micro-batch size, as the batch says), ``make_batch_generator``, ``concat_tensordict``,
``preprocess_thd_engine`` and ``postprocess_batch_func`` (per-token ``log_probs`` in sample order):
the packed stream the harness model gets is verl's (per-sequence TP/SP alignment, CP zigzag),
checked row for row against the CP-local ids verl's packer computes.

Batches are verl's transport (``tests/adapters/_verl_batches.verl_batch``: the agent loop's padded
``routed_experts``, then verl's ``left_right_2_no_padding``). R2 routes go the way verl's trainer
moves them: read from the last stage's ``model_output`` (the rank verl collects outputs from),
handed to every rank, written into the batch the update is cut from.
"""
from __future__ import annotations

import contextlib
from functools import partial
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from _verl_batches import verl_batch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from r3bridge.adapters.verl.codec import ROUTES_KEY, VerlCodec
from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import ReplayConfig
from r3bridge.session.phase import PhaseRunner
from r3bridge.testing.harness.data import PackedBatch, local_inputs
from r3bridge.testing.harness.schedule import make_forward_step
from r3bridge.testing.kit.conformance import TWO_RANK, CanonicalRollout
from r3bridge.testing.kit.suite import AdapterFixtures

__all__ = ["HarnessVerl", "VerlEngine", "VerlRunner", "VerlFixtures", "build_engine", "hf_config_of",
           "token_log_probs", "verl_packed_batch"]

INDEX_KEY = "conformance_sample"     # test-side: the rollout sample of each row, to pair outputs


def verl_packed_batch(input_ids: torch.Tensor, model: torch.nn.Module, ctx: Any) -> PackedBatch:
    """The un-split packed stream of one verl micro-batch as verl's ``preprocess_thd_engine``
    packs it (its ``cu_seqlens_padded``; true lengths from the nested offsets, as verl reads
    them), as a harness :class:`PackedBatch`.
    Raises if the harness's CP-local rows are not the ones verl's packer gives this rank."""
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron_utils import unwrap_model

    layout = MegatronEngineWithLMHead._get_context_parallel_layout(unwrap_model(model))
    local, params, _ = preprocess_thd_engine(input_ids, pre_process=True, cp_layout=layout)
    cup = params.cu_seqlens_q_padded.cpu().to(torch.int32)
    cu = torch.nn.functional.pad(input_ids.offsets().diff().cumsum(0), (1, 0)).cpu().to(torch.int32)
    lens, padded = cu.diff().tolist(), cup.diff().tolist()
    total = int(cup[-1])
    ids, labels = torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64)
    mask, pos = torch.zeros(total), torch.zeros(total, dtype=torch.int64)
    for toks, off, n, p in zip(input_ids.unbind(), cup.tolist(), lens, padded):
        ids[off:off + n] = toks
        labels[off:off + n - 1] = toks[1:]
        mask[off:off + n - 1] = 1.0
        pos[off:off + p] = torch.arange(p)
    batch = PackedBatch(lens, padded, ids, labels, mask, pos, cu, cup)
    mine = local_inputs(batch, ctx.cp, ctx.cp_rank)["input_ids"].reshape(-1)
    if not torch.equal(mine, local.reshape(-1).cpu().to(mine.dtype)):
        raise AssertionError(f"cp rank {ctx.cp_rank}: the harness's local rows differ from verl's packing")
    return batch


class HarnessVerl(MegatronEngineWithLMHead):
    """Stands in for the schedule call of verl's ``forward_backward_batch`` and the model-running
    body of its ``forward_step``: verl's own fixed-size micro-batching and batch generator feed
    megatron's schedule; each micro-batch runs the harness forward step on verl's THD packing.
    ``self.results``: the last stage's (logits, packed stream) of each micro-batch."""

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from verl.utils.megatron.pipeline_parallel import make_batch_generator
        from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        micro, indices = prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=False,
                                               num_batches_divided_by=self.tf_config.microbatch_group_size_per_vp_stage
                                               if vpp is not None and vpp > 1 else None)
        fs = partial(self.forward_step, logits_processor_func=loss_function, postprocess_micro_batch_func=None)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            store = get_forward_backward_func()(
                forward_step_func=fs, data_iterator=make_batch_generator(micro, vpp_size=len(self.module)),
                model=self.module, num_microbatches=len(micro), seq_length=1, micro_batch_size=1,
                forward_only=forward_only)
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        self.results = [(item["logits"], item["packed"]) for item in store]
        self.handed_log_ratio = [item.get("handed_log_ratio") for item in store]
        # verl's own post-processing: per-token log-probs (nested, one row per token) back in
        # the batch's sample order (dynamic batching re-orders samples)
        outs = [{"model_output": {"log_probs": token_log_probs(logits, packed)}, "metrics": {}}
                for logits, packed in self.results]
        return postprocess_batch_func(outs, indices, data)

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch = next(batch_iter)
        packed = verl_packed_batch(batch["input_ids"], model, self.ctx)
        chunk = next(i for i, c in enumerate(self.module) if c is model)
        self.fed.append((chunk, batch[INDEX_KEY].tolist() if INDEX_KEY in batch.keys() else None, packed))
        output, loss = self.inner(iter([packed]), model)

        def loss_func(per_token):
            value, reduced = loss(per_token)
            # what a verl loss reading its micro-batch ``data`` sees (r3bridge.router_log_ratio)
            handed = batch.get("router_log_ratio", None)
            return value, {**reduced, "packed": packed, "handed_log_ratio": handed}
        return output, loss_func


def token_log_probs(logits: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """verl's ``log_probs`` of one micro-batch from the harness's packed logits: nested, one
    value per token, position t the log-prob of token t+1 (verl rolls the labels; a sequence's
    last position has no next token here and holds 0, outside every response slice)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    per_seq = []
    for off, n in zip(packed.cu_seqlens_padded.tolist(), packed.seq_lens):
        out = torch.zeros(n)
        rows = torch.arange(off, off + n - 1)
        out[:n - 1] = logp[rows, packed.input_ids[rows + 1]]
        per_seq.append(out)
    return torch.nested.as_nested_tensor(per_seq, layout=torch.jagged)


class VerlEngine(R3BridgeMegatronEngine, HarnessVerl):
    """The adapter's engine over the stand-in (the MRO a registered engine has over verl's)."""


class _KeepResults(PhaseRunner):
    """The engine's own PhaseRunner, also keeping each phase's result: verl returns r3bridge's
    metrics only from the last stage (tagged, compute_log_prob's held for the update), while the
    checks read the driver's metrics on every rank."""

    def __init__(self, runner: PhaseRunner) -> None:
        super().__init__(runner.replayer, runner.config, carry_log_prob_metrics=runner.carry)
        self.results: list = []

    @contextlib.contextmanager
    def run(self, phase, **kw):
        with super().run(phase, **kw) as ps:
            yield ps
        self.results.append(None if ps is None else ps.result)


def hf_config_of(tf_config: Any) -> dict:
    """The HF config a verl job of this harness model would carry (DeepSeek-V3 style: leading
    dense layers, then MoE every layer)."""
    freq = tf_config.moe_layer_freq
    moe = [i for i in range(tf_config.num_layers) if (freq[i] if isinstance(freq, list) else i % freq == 0)]
    dense = moe[0] if moe else tf_config.num_layers
    if moe != list(range(dense, tf_config.num_layers)):
        raise ValueError(f"MoE layers {moe} are not one block after the dense ones")
    return {"model_type": "deepseek_v3", "num_hidden_layers": tf_config.num_layers, "first_k_dense_replace": dense,
            "n_routed_experts": tf_config.num_moe_experts, "num_experts_per_tok": tf_config.moe_router_topk}


def build_engine(ctx: Any, chunks: list, mode: str, *, reference: bool = False, **options: Any) -> VerlEngine:
    """The adapter's engine over ``chunks`` with ``replay_mode=mode`` (and the other r3bridge
    ``options``), attached by its own ``r3_attach`` (``reference``: verl's reference engine,
    ``engine_config.forward_only``).
    ``eng.fed``: (chunk, rollout samples, packed stream) of every forward step, in call order."""
    cfg = chunks[0].config
    cfg.finalize_model_grads_func = None        # the harness has no DDP wrapper to finalize
    cfg.grad_scale_func = None
    if len(chunks) > 1:
        # what verl's engine sets under VPP (MegatronEngine's TransformerConfig overrides:
        # overlap_p2p_comm with VPP, batch_p2p_comm off, variable_seq_lengths). Overlapped p2p
        # sends each direction on its own: megatron-core 0.16.1's combined forward+backward
        # shape exchange crosses prev and next when both are one rank (PP 2)
        cfg.microbatch_group_size_per_vp_stage = ctx.pp
        cfg.overlap_p2p_comm = True
    eng = VerlEngine.__new__(VerlEngine)        # verl's __init__ builds model and optimizer itself
    eng.engine_config = SimpleNamespace(forward_only=reference, use_remove_padding=True, pad_to_length=False,
                                        dynamic_context_parallel=False,
                                        router_replay=SimpleNamespace(mode="disabled"))
    eng.model_config = SimpleNamespace(hf_config=hf_config_of(cfg))
    eng.tf_config = cfg
    eng.module = chunks
    eng.ctx = ctx
    eng.fed = []
    eng.inner = make_forward_step(ctx, thd=True, collect_logits=True)
    eng.r3_init_state(ReplayConfig(replay_mode=mode, **options))
    eng.r3.runner = _KeepResults(eng.r3.runner)
    eng.r3_attach()
    eng.replayer = eng.r3.replayer              # what the r3 check reads the layout from
    return eng


class VerlRunner:
    """:class:`r3bridge.testing.kit.conformance.MegatronRunner` for verl (``make_runner(rollout)``)."""

    def __init__(self, rollout: CanonicalRollout) -> None:
        self.rollout = rollout
        self.codec = VerlCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                               num_hidden_layers=rollout.num_layers)
        self.batch = verl_batch(rollout)                      # the trainer's whole batch, sample order
        self.batch[INDEX_KEY] = torch.arange(rollout.batch_size)
        self.outputs: list[dict] = []                         # verl's output of every pass (last stage)

    # ------------------------------------------------------------------------------ protocol
    def attach(self, ctx: Any, chunks: list, mode: str) -> VerlEngine:
        self.engine = build_engine(ctx, chunks, mode)
        return self.engine

    def micro_batches(self, rollout: CanonicalRollout, groups, *, key: Optional[str]) -> list:
        """verl TensorDicts of ``groups``; without ``routed_experts`` for an R2 recording pass
        (the rollout replays nothing), the rollout's or the recorded routes otherwise."""
        out = []
        for g in groups:
            mb = tu.index_select_tensor_dict(self.batch, torch.tensor(list(g)))
            if key is None:
                mb.pop(ROUTES_KEY)
            out.append(mb)
        return out

    def run(self, eng: VerlEngine, mbs: list, *, phase: str) -> dict:
        """One ``forward_backward_batch`` over the concatenated micro-batches (forward only for
        compute_log_prob, forward + backward for the update), micro-batched by verl into
        ``mbs``' sizes."""
        sizes = {len(mb) for mb in mbs}
        if len(sizes) != 1:
            raise ValueError(f"verl's fixed-size micro-batching needs equal groups, got sizes {sorted(sizes)}")
        data = tu.concat_tensordict(mbs)
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=sizes.pop())
        order = data[INDEX_KEY].tolist()
        packing = []

        def note(module, args, kwargs):
            psp = kwargs["packed_seq_params"]
            packing.append(dict(seq_lens=psp.cu_seqlens_q.diff().tolist(), format="thd",
                                cu_seqlens_padded=psp.cu_seqlens_q_padded.cpu()))
        forward_only = phase == "compute_log_prob"
        for c in eng.module:                        # verl's EngineEvalModeCtx / EngineTrainModeCtx
            c.train(not forward_only)
        h = eng.module[0].register_forward_pre_hook(note, with_kwargs=True)
        try:
            output = eng.forward_backward_batch(data, None, forward_only=forward_only)
        finally:
            h.remove()
        if not forward_only:
            for c in eng.module:                    # the update's gradients are not stepped here
                for p in c.parameters():
                    p.grad = None
        self.outputs.append(output)
        result = eng.r3.runner.results[-1]
        recorded = None
        if result is not None and result.recorded is not None:
            recorded = self._recorded_from_output(output, data, order)
        logprobs = []
        if output:
            for logits, packed in eng.results:
                for off, n in zip(packed.cu_seqlens_padded.tolist(), packed.seq_lens):
                    logprobs.append(logits[off:off + n])
        return {"logprobs": logprobs, "metrics": dict(result.metrics) if result is not None else {},
                "recorded": recorded, "packing": packing,
                "framework_metrics": output.get("metrics") if output else None}

    def write_recorded(self, rollout: CanonicalRollout, recorded: ReplayBatch) -> None:
        """verl's trainer keeps the returned routes in the batch the update's mini-batches are cut from."""
        self.batch = self.codec.write_recorded(self.batch, recorded)

    # ------------------------------------------------------------------------------ helpers
    def _recorded_from_output(self, output: dict, data, order: list[int]) -> ReplayBatch:
        """R2 routes as verl hands them on: the nested ``routed_experts`` of the output of the
        last stage's first TP/CP rank (where verl's dispatcher collects), given to every rank;
        returned in rollout sample order."""
        from megatron.core import parallel_state as ps

        src = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
               and ps.get_context_parallel_rank() == 0)
        flags = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(flags, src)
        payload = [None]
        if src:
            data[ROUTES_KEY] = output["model_output"][ROUTES_KEY]
            payload = [self.codec.to_replay_batch(data, route_kind="recorded").to_bytes()]
        torch.distributed.broadcast_object_list(payload, src=flags.index(True))
        rb = ReplayBatch.from_bytes(payload[0])
        back = sorted(range(len(order)), key=order.__getitem__)
        return rb.select(back)


class VerlFixtures(AdapterFixtures):
    """verl's objects for the conformance kit (:mod:`r3bridge.testing.kit.suite`): the codec, the
    batch verl's trainer holds (``verl_batch``), the runner; checks 4-5 on the 2-rank layouts."""

    @pytest.fixture
    def codec(self, rollout):
        return VerlCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                         num_hidden_layers=rollout.num_layers)

    @pytest.fixture
    def native_batch(self, rollout):
        return verl_batch(rollout)

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_runner(cls):
        return VerlRunner

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls):
        return TWO_RANK
