"""SkyRL's real training path on harness chunks (test-only), SkyRL 0.3 or 0.4 (the installed one).

What runs is SkyRL's own code: ``MegatronModelWrapper.forward`` (the forward-only log-prob pass)
and ``forward_backward_mini_batch`` (one mini-batch update with SkyRL's registered policy loss and
KL term, under megatron's real ``DistributedDataParallel`` and ``finalize_model_grads``), SkyRL's
``TrainingInputBatch`` / ``BatchIterator`` micro-batching, and r3bridge's adapter classes on top
(``PolicyWorkerMixin`` swapping in the replaying wrapper, R2 sample ids and recorded payloads;
``SkyRLCodec.write_recorded``, which is what ``TrainerMixin`` writes back into the batch).

The one piece that is not SkyRL's: :class:`PolicyWorkerStandIn`, in place of
``MegatronPolicyWorkerBase``. SkyRL's worker module imports ``megatron.bridge`` (Megatron-Bridge,
which builds models through Transformer Engine) at module level, so it cannot be imported here.
The stand-in does what that worker does between the trainer and the wrapper (chunk the batch,
build one dict per micro-batch, call the wrapper, turn log-probs into ``loss_fn_outputs``) and
nothing else; it never touches routes except to pass ``rollout_expert_indices`` through when
``enable_router_replay`` is set, as SkyRL's worker does.

:func:`run_steps` is a rank function body: it trains for a few steps and returns picklable
results, including every router call checked against the routes that should have been replayed
(the routing probe, forward passes and recomputes alike).

SkyRL 0.4 (Python >= 3.12; ``scripts/gpu/skyrl04_train.py`` on the device): the batch carries
0.4's own transport (``RoutedExpertTrace`` per sample, ``PackedTensor`` routes with
``router_padding_mask``, :func:`batch04`), the stand-in passes routes and mask as 0.4's worker does
and runs the wrapper's deferred gradient sync (``run_pending_grad_sync``) in ``optim_step``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.sharding import shard
from r3bridge.testing.kit.conformance import CanonicalRollout

__all__ = ["StepSpec", "PolicyWorkerStandIn", "train_device", "to_train_device", "check_param_devices", "RefWorkerStandIn", "reference_roles", "training_input", "run_steps", "check_router_calls", "log_dispatch"]

_WRAPPER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"


def _skyrl(name: str):
    from r3bridge.adapters.skyrl._compat import import_skyrl
    return import_skyrl(name)


@dataclass
class StepSpec:
    """One cell: replay mode, SkyRL's packing choice, micro-batch sizes, steps."""

    mode: str                                  # "R3" | "R2" | "off"
    remove_microbatch_padding: bool = True     # THD (True) or SkyRL's left-padding removal (BSHD)
    micro_forward_batch_size: int = 2          # compute_log_prob micro-batches
    micro_train_batch_size: int = 4            # update micro-batches (re-partitioned on purpose)
    permute: Optional[list[int]] = None        # sample order of the update batch (dynamic sampling)
    lr: float = 0.05
    extra: dict = field(default_factory=dict)
    trace_dir: Optional[str] = None            # the r3bridge option trace_dir (route traces)
    route_transport: str = "inline"            # "handles": TrainerMixin's RouteWriter writes, workers read by reference
    routes_dir: Optional[str] = None           # route_store's folder override (handles; default: the section's, /dev/shm/r3bridge-routes)


# ------------------------------------------------------------------------------------ batches
def training_input(rollout: CanonicalRollout, *, seed: int = 0):
    """The ``TrainingInputBatch`` SkyRL's trainer hands the policy worker: SkyRL's own
    ``convert_prompts_responses_to_batch_tensors`` (left-padded sequences, the generator's routes
    accumulated first-seen as r3bridge's ``FirstSeenRoutesMixin`` leaves them), plus the fields the
    update reads (advantages; old / base log-probs are filled in after compute_log_prob)."""
    if _release() == "0.4":
        return _training_input04(rollout, seed=seed)
    pre = _skyrl("skyrl.train.dataset.preprocess")
    tb = _skyrl("skyrl.backends.skyrl_train.training_batch")
    prompts = [t[:p] for t, p in zip(rollout.tokens, rollout.prompt_lens)]
    responses = [t[p:] for t, p in zip(rollout.tokens, rollout.prompt_lens)]
    routes = generator_routes(rollout)
    tok = type("Tok", (), {"pad_token_id": 0})()      # convert_* reads only pad_token_id
    seqs, attn, resp_mask, rewards, loss_mask, _, rei = pre.convert_prompts_responses_to_batch_tensors(
        tok, prompts, responses, [[0.0] * len(r) for r in responses], [[1] * len(r) for r in responses],
        None, routes)
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(resp_mask.shape, generator=g) * resp_mask
    batch = tb.TrainingInputBatch({
        "sequences": seqs, "attention_mask": attn, "response_mask": resp_mask, "loss_mask": loss_mask,
        "rewards": rewards, "advantages": adv, "rollout_expert_indices": rei})
    batch.metadata = {"response_length": int(resp_mask.shape[1]), "uids": [str(i) for i in range(len(prompts))]}
    return batch


def generator_routes(rollout: CanonicalRollout) -> list:
    """Each sample's ``rollout_expert_indices`` as SkyRL 0.3's generator returns them: nested lists
    ``[rows, num_hidden_layers, K]``, the turns accumulated first-seen as r3bridge's
    ``FirstSeenRoutesMixin`` leaves them."""
    from r3bridge.adapters.skyrl.rollout import merge_first_seen

    routes = []
    for calls in rollout.calls:
        acc = None
        for c in calls:
            acc = merge_first_seen(acc, c.tolist())
        routes.append(acc)
    return routes


def _release() -> Optional[str]:
    from r3bridge.adapters.skyrl._compat import skyrl_release
    return skyrl_release()


def batch04(rollout: CanonicalRollout):
    """SkyRL 0.4's transport of ``rollout``, built by SkyRL 0.4's own code: one generator-side
    ``RoutedExpertTrace`` per sample fed call by call (the engine answers from the trace's
    ``prompt_start``, as SkyRL 0.4's request asks), ``convert_prompts_responses_to_batch_tensors``
    (``PackedTensor`` routes) and ``make_router_padding_mask``. Returns (the tensors
    ``convert_prompts_responses_to_batch_tensors`` returned, router padding mask)."""
    pre = _skyrl("skyrl.train.dataset.preprocess")
    routes = generator_routes04(rollout)
    prompts = [t[:p] for t, p in zip(rollout.tokens, rollout.prompt_lens)]
    responses = [t[p:] for t, p in zip(rollout.tokens, rollout.prompt_lens)]
    out = pre.convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, [[0.0] * len(r) for r in responses], [[1] * len(r) for r in responses],
        None, routes, None)
    return out, pre.make_router_padding_mask(out[1], [len(r) for r in routes])


def generator_routes04(rollout: CanonicalRollout) -> list:
    """Each sample's ``rollout_expert_indices`` as SkyRL 0.4's generator returns them: one
    ``RoutedExpertTrace`` per sample fed call by call (the engine answering from the trace's
    ``prompt_start``, as 0.4's request asks), finalized: the routed prefix, nothing fabricated."""
    import numpy as np

    trace_mod = _skyrl("skyrl.backends.skyrl_train.utils.routed_experts")
    routes = []
    for i, calls in enumerate(rollout.calls):
        trace = trace_mod.RoutedExpertTrace()
        for c, toks, plen in zip(calls, rollout.call_tokens[i], rollout.call_prompt_lens[i]):
            trace.record_generation(prompt_token_count=plen, generated_token_count=len(toks) - plen,
                                    routed_experts=np.ascontiguousarray(c[trace.prompt_start:]))
        n = len(rollout.tokens[i])
        routes.append(trace.finalize(token_count=n, loss_mask=[0] * n))
    return routes


def _training_input04(rollout: CanonicalRollout, *, seed: int):
    tb = _skyrl("skyrl.backends.skyrl_train.training_batch")
    (seqs, attn, resp_mask, rewards, loss_mask, _, rei, _), mask = batch04(rollout)
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(resp_mask.shape, generator=g) * resp_mask
    batch = tb.TrainingInputBatch({
        "sequences": seqs, "attention_mask": attn, "response_mask": resp_mask, "loss_mask": loss_mask,
        "rewards": rewards, "advantages": adv, "rollout_expert_indices": rei, "router_padding_mask": mask})
    batch.metadata = {"response_length": int(resp_mask.shape[1]), "uids": [str(i) for i in range(len(rollout.tokens))]}
    return batch


def _reindexed(batch, order: Sequence[int]):
    """The batch with its samples in ``order`` (what dynamic sampling / shuffling does)."""
    idx = torch.tensor(list(order))
    out = type(batch)({k: (None if v is None else v[idx]) for k, v in batch.items()})
    out.metadata = dict(batch.metadata)
    return out


# ------------------------------------------------------------------------------------ worker
def _positions(attn: torch.Tensor) -> torch.Tensor:
    return (attn.long().cumsum(-1) - 1).clamp(min=0)


def ddp_wrap(chunks: list, config: Any) -> list:
    """megatron's ``DistributedDataParallel`` around each chunk, as SkyRL's
    ``make_megatron_module(wrap_with_ddp=True)`` does: SkyRL's wrapper installs megatron's
    ``finalize_model_grads``, which reduces gradients through the DDP grad buffers."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=False)
    return [DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=c,
                                    disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]


def train_device() -> torch.device:
    """Where megatron's ``DistributedDataParallel`` puts its grad buffers (``param.main_grad``):
    ``torch.cuda.current_device()``, this rank's GPU under NCCL, "cpu" under the CPU shim."""
    dev = torch.cuda.current_device()
    return torch.device(dev) if isinstance(dev, str) else torch.device("cuda", dev)


def to_train_device(chunks: Sequence[torch.nn.Module]) -> torch.device:
    """Every chunk on :func:`train_device`, as Megatron-Bridge's ``get_model`` (SkyRL's
    ``make_megatron_module`` -> ``provide_distributed_model``) moves each chunk with
    ``.cuda(torch.cuda.current_device())`` before wrapping it in DDP. The harness's TE build
    leaves parameters on the host that megatron creates without a device (the router's
    ``weight``, ``torch.empty`` in moe/router.py; the learned position embedding,
    ``torch.nn.Embedding``); megatron's router moves only its own weight at its first forward
    (``TopKRouter.gating``), so an unused one (the position embedding under SkyRL's THD path)
    stayed on the host while DDP put its ``main_grad`` on the GPU."""
    dev = train_device()
    for c in chunks:
        c.to(dev)
    return dev


def check_param_devices(modules: Sequence[torch.nn.Module], params: Sequence[torch.nn.Parameter]) -> None:
    """Every trained parameter on the device of its DDP grad buffer (``main_grad``); an
    AssertionError naming each one that is not (the optimizer step would assign a gradient
    of another device)."""
    names = {id(p): n for m in modules for n, p in m.named_parameters()}
    bad = [f"{names.get(id(p), '?')}: param on {p.device}, main_grad on {p.main_grad.device}"
           for p in params if getattr(p, "main_grad", None) is not None and p.device != p.main_grad.device]
    assert not bad, f"{len(bad)} parameter(s) not on their grad buffer's device: " + "; ".join(bad[:8])


class PolicyWorkerStandIn:
    """Stand-in for SkyRL 0.3's ``MegatronPolicyWorkerBase`` (see the module docstring): the
    trainer-facing methods ``init_configs`` / ``init_model`` / ``forward`` / ``forward_backward``
    / ``optim_step``, on harness chunks. ``r3bridge.adapters.skyrl.PolicyWorkerMixin`` goes in
    front of it exactly as in production."""

    def __init__(self, cfg: Any, chunks: list, hf_config: dict) -> None:
        self.cfg = cfg
        self._chunks = chunks
        self.strategy = type("Strategy", (), {"hf_config": hf_config})()
        self.enable_router_replay = False
        self.model = None
        self.actor_module: list = []
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.release = _release()

    def init_configs(self, model_path, megatron_config, *args, **kwargs):
        self.enable_router_replay = bool(megatron_config.moe_enable_routing_replay)
        self.megatron_config = megatron_config

    def init_model(self, model_path: str = "harness", num_training_steps: int = 1):
        self.init_configs(model_path, self.cfg.policy.megatron_config)
        wrapper = _skyrl(_WRAPPER)
        ppo = _skyrl("skyrl.backends.skyrl_train.utils.ppo_utils")
        to_train_device(self._chunks)
        self.actor_module = ddp_wrap(self._chunks, self._chunks[0].config)
        params = [p for c in self.actor_module for p in c.parameters() if p.requires_grad]
        check_param_devices(self.actor_module, params)
        # megatron's optimizers allocate on CUDA (docs/testing-harness.md): plain SGD over the
        # DDP grad buffers (param.main_grad), after finalize_model_grads reduced them
        self.optimizer = torch.optim.SGD(params, lr=self.cfg.policy.optimizer_config.lr)
        self.model = wrapper.MegatronModelWrapper(
            config=self.cfg, actor_module=self.actor_module, actor_optimizer=None,
            policy_loss_fn=ppo.PolicyLossRegistry.get(self.cfg.algorithm.policy_loss_type), is_vlm=False)

    def _micro_dict(self, mb) -> dict:
        """A compute_log_prob micro-batch (a ``TrainingInputBatch`` chunk) as SkyRL's worker builds it."""
        attn = mb["attention_mask"]
        rei = mb.get("rollout_expert_indices")
        out = {"sequences": mb["sequences"], "attention_mask": attn, "position_ids": _positions(attn),
               "num_actions": mb.metadata["response_length"],
               "rollout_expert_indices": self._routes(rei), "sub_seq_lengths": mb.get("sub_seq_lengths")}
        if self.release == "0.4":
            out["router_padding_mask"] = mb.get("router_padding_mask") if self.enable_router_replay else None
        return out

    def _train_dict(self, exp) -> dict:
        """An update micro-batch (SkyRL's ``Experience`` from ``BatchIterator``) as SkyRL's worker builds it."""
        return {"sequences": exp.sequences, "attention_mask": exp.attention_mask,
                "position_ids": _positions(exp.attention_mask), "num_actions": exp.num_actions,
                "old_action_log_probs": exp.action_log_probs, "base_action_log_probs": exp.base_action_log_probs,
                "advantages": exp.advantages, "loss_mask": exp.loss_mask,
                "rollout_action_logprobs": exp.rollout_logprobs, "action_mask": getattr(exp, "action_mask", None),
                "rollout_expert_indices": self._routes(exp.rollout_expert_indices),
                "sub_seq_lengths": exp.sub_seq_lengths, "is_padding_batch": False,
                **({"response_mask": exp.response_mask,
                    "router_padding_mask": exp.router_padding_mask if self.enable_router_replay else None}
                   if self.release == "0.4" else {})}

    def _routes(self, rei):
        if rei is None or not self.enable_router_replay:
            return None
        # 0.3's worker casts its dense routes to int32; 0.4's passes its PackedTensor as it is
        return rei if self.release == "0.4" else rei.to(torch.int32)

    def forward(self, data, loss_fn=None, loss_fn_config=None):
        dispatch = _skyrl("skyrl.backends.skyrl_train.distributed.dispatch")
        mbs = [self._micro_dict(m) for m in data.chunk(self.cfg.micro_forward_batch_size_per_gpu)]
        self.model.eval()
        with torch.no_grad():
            lp = self.model.forward(micro_batches=mbs, seq_len=mbs[0]["sequences"].shape[1],
                                    micro_batch_size=mbs[0]["sequences"].shape[0],
                                    temperature=self.cfg.algorithm.temperature)
        return dispatch.WorkerOutput(loss_fn_outputs=[{"logprobs": lp[i].tolist()} for i in range(lp.shape[0])],
                                     metrics={})

    def forward_backward(self, data, loss_fn=None, loss_fn_config=None):
        dispatch = _skyrl("skyrl.backends.skyrl_train.distributed.dispatch")
        wu = _skyrl("skyrl.backends.skyrl_train.workers.worker_utils")
        self.model.train()
        for c in self.actor_module:
            c.zero_grad_buffer()
        mbs = [self._train_dict(e) for e in wu.BatchIterator(data, self.cfg.micro_train_batch_size_per_gpu)]
        for m in mbs:
            m["num_microbatches"] = len(mbs)
            m["num_real_microbatches"] = len(mbs)
        metrics = self.model.forward_backward_mini_batch(
            micro_batches=mbs, seq_len=mbs[0]["sequences"].shape[1], micro_batch_size=mbs[0]["sequences"].shape[0],
            temperature=self.cfg.algorithm.temperature, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
            # SkyRL 0.4's worker passes this too (megatron_worker.py:1205)
            **({"return_per_token_outputs": True} if self.release == "0.4" else {}))
        outs = [o for m in metrics for o in m.pop("loss_fn_outputs", [])]
        return dispatch.WorkerOutput(loss_fn_outputs=outs, metrics={"micro_batches": metrics})

    def optim_step(self) -> float:
        """SGD over the DDP main grads (megatron's optimizer would read the same buffers)."""
        if hasattr(self.model, "run_pending_grad_sync"):   # SkyRL 0.4 defers finalize_model_grads to here
            self.model.run_pending_grad_sync()
        norm = 0.0
        check_param_devices(self.actor_module, self.optimizer.param_groups[0]["params"])
        for p in self.optimizer.param_groups[0]["params"]:
            p.grad = p.main_grad.to(p.dtype, copy=True)      # bf16 params (the GPU runs) keep their dtype
            norm += float(p.grad.double().pow(2).sum())
        self.optimizer.step()
        for p in self.optimizer.param_groups[0]["params"]:
            p.grad = None
        return norm ** 0.5


# ------------------------------------------------------------------------------------ checks
class PackingNotes:
    """Per chunk, the packing each forward really used (SkyRL's ``packed_seq_params`` under THD,
    the ``[b, s]`` shape after its left-padding removal under BSHD), from a forward pre-hook."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.chunks = list(chunks)
        self.notes: list[list[dict]] = [[] for _ in self.chunks]
        self._hs: list = []

    def __enter__(self) -> "PackingNotes":
        for c, chunk in enumerate(self.chunks):
            self._hs.append(chunk.register_forward_pre_hook(self._note(c), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hs:
            h.remove()
        self._hs.clear()

    def _note(self, c: int):
        def pre(module, args, kwargs):
            psp = kwargs.get("packed_seq_params")
            if psp is not None:
                self.notes[c].append({"format": "thd", "cu_seqlens_padded": psp.cu_seqlens_q_padded.cpu().clone()})
            else:
                pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
                self.notes[c].append({"format": "bshd", "seq_length": int(pos.shape[1])})
        return pre


class RefWorkerStandIn:
    """Stand-in for SkyRL 0.3's ``MegatronRefWorkerBase`` (which imports Megatron-Bridge): what its
    ``init_configs`` / ``init_model`` do with the model, on harness chunks built as SkyRL's
    ``MegatronWorker`` builds them (``provider.moe_enable_routing_replay`` from
    ``trainer.ref.megatron_config``), wrapped in SkyRL's plain ``MegatronModelWrapper``."""

    def __init__(self, cfg: Any, chunks: list) -> None:
        self.cfg = cfg
        self._chunks = chunks
        self.actor_module: list = []
        self.model = None
        self.enable_router_replay = False

    def init_model(self, model_path: str = "harness", num_training_steps: int = 1):
        mc = self.cfg.ref.megatron_config
        self.enable_router_replay = bool(mc.moe_enable_routing_replay)      # as MegatronWorker.init_configs
        self.actor_module = list(self._chunks)
        wrapper = _skyrl(_WRAPPER)
        self.model = wrapper.MegatronModelWrapper(config=self.cfg, actor_module=self.actor_module,
                                                  actor_optimizer=None, policy_loss_fn=None, is_vlm=False)


def reference_roles(ctx: Any, spec: Any) -> dict:
    """SkyRL's reference worker with r3bridge's ``RefWorkerMixin``, built with and without
    ``trainer.ref.megatron_config.moe_enable_routing_replay``: the role its routers carry, or the
    error the build raised (SkyRL would then drive the reference's RouterReplay with the actor's
    rollout routes through megatron's process-global list: NeMo RL #4083)."""
    import dataclasses

    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3bridge.adapters.skyrl import RefWorkerMixin
    from r3bridge.errors import ReplayError
    from r3bridge.megatron.roles import model_routers, role_of
    from r3bridge.testing.harness.models import build_model_chunks

    worker_cls = type("HarnessRefWorker", (RefWorkerMixin, RefWorkerStandIn), {})
    out: dict = {}
    for flag in (False, True):
        cfg = _skyrl("skyrl.train.config").TrainerConfig()
        cfg.ref.megatron_config.moe_enable_routing_replay = flag
        built = len(RouterReplay.global_router_replay_instances)
        chunks = build_model_chunks(dataclasses.replace(
            spec, extra_config={**spec.extra_config, "moe_enable_routing_replay": flag}), ctx)
        worker = worker_cls(cfg, chunks)
        try:
            worker.init_model()
            out[flag] = {"roles": sorted({str(getattr(role_of(r), "value", None)) for c in chunks for _, r in model_routers(c)}),
                         "error": None}
        except ReplayError as e:
            out[flag] = {"roles": None, "error": f"{type(e).__name__}: {e}"}
        finally:
            del RouterReplay.global_router_replay_instances[built:]     # never pruned by megatron
    return out


def check_router_calls(ctx: Any, calls: list, notes: list[list[dict]], groups: Sequence[Sequence[int]],
                       seq_lens: Sequence[int], routes: ReplayBatch, layout: ParallelLayout, *,
                       passes: set[bool], mismatched: Optional[list] = None) -> tuple[list[str], int]:
    """Every router call against ``routes`` (one sequence per sample, canonical form): calls of one
    (chunk, layer) are split by grad mode (``passes``: False = a no-grad pass, forward-only or the
    first pass of a recomputed layer; True = a pass with grad, the recompute or a plain training
    forward), each must hold one call per micro-batch in schedule order, and on every valid row the
    top-k a router dispatched must be the target ``r3bridge.shard`` gives for that rank, chunk and
    the packing SkyRL really used. Returns (errors, checked valid rows); ``mismatched`` (a list)
    gets the number of valid rows per call whose dispatched top-k differs (all of a call's rows when
    its shape differs)."""
    errors: list[str] = []
    checked = 0
    by: dict[tuple[int, int], dict[bool, list]] = {}
    for call in calls:
        by.setdefault((call.chunk, call.layer_id), {}).setdefault(call.grad_enabled, []).append(call)
    for (c, lid), per in sorted(by.items()):
        if set(per) != passes:
            errors.append(f"chunk {c} layer {lid}: router passes with grad {sorted(per)}, expected {sorted(passes)}")
            continue
        for grad, cs in per.items():
            if len(cs) != len(groups) or len(notes[c]) != len(groups):
                errors.append(f"chunk {c} layer {lid} grad={grad}: {len(cs)} router calls, {len(notes[c])} chunk "
                              f"forwards for {len(groups)} micro-batches")
                continue
            for k, (call, g) in enumerate(zip(cs, groups)):
                tg = shard(routes.select(list(g)), layout, [seq_lens[i] for i in g], tp_rank=ctx.tp_rank,
                           cp_rank=ctx.cp_rank, pp_rank=ctx.pp_rank, vp_stage=c, layer_ids=[lid], **notes[c][k])
                got, want, v = call.topk().cpu(), tg.indices[lid].sort(dim=1).values, tg.valid
                if got.shape != want.shape:
                    errors.append(f"chunk {c} layer {lid} micro-batch {k} grad={grad}: router saw "
                                  f"{tuple(got.shape)} rows, targets {tuple(want.shape)}")
                    bad = int(v.sum())
                else:
                    bad = int((got[v] != want[v]).any(1).sum())
                    if bad:
                        errors.append(f"chunk {c} layer {lid} micro-batch {k} grad={grad}: "
                                      f"{bad} of {int(v.sum())} valid rows differ")
                if mismatched is not None:
                    mismatched.append(bad)
                checked += int(v.sum())
    if not by:
        errors.append("no router call was recorded")
    return errors, checked


def log_dispatch(ctx: Any, log: Any, step: int, phase: str, calls: list, notes: list[list[dict]],
                 groups: Sequence[Sequence[int]], seq_lens: Sequence[int], layout: ParallelLayout) -> None:
    """Every real row of every router call into ``log`` (a
    :class:`~testlab.dispatch_records.DispatchLog`), mapped to (sample, token) with the
    packing SkyRL really used (calls of one (chunk, layer, grad mode) run the micro-batches in order)."""
    from testlab.dispatch_records import router_rows

    seen: dict[tuple[int, int, bool], int] = {}
    for call in calls:
        key = (call.chunk, call.layer_id, call.grad_enabled)
        k = seen[key] = seen.get(key, -1) + 1
        if k >= len(groups) or k >= len(notes[call.chunk]):
            raise AssertionError(f"{phase} chunk {call.chunk} layer {call.layer_id} grad={call.grad_enabled}: "
                                 f"more router calls than the {len(groups)} micro-batches")
        g = list(groups[k])
        sample, token = router_rows(g, [seq_lens[i] for i in g], layout, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                                    **notes[call.chunk][k])
        log.add(step=step, phase=phase, grad=call.grad_enabled, layer=call.layer_id, topk=call.topk().cpu(),
                sample=sample, token=token)


def _groups(order: Sequence[int], size: int) -> list[list[int]]:
    order = list(order)
    return [order[i:i + size] for i in range(0, len(order), size)]


def _from_last_stage(t: Optional[torch.Tensor], shape: tuple) -> torch.Tensor:
    """The last pipeline stage's tensor on every stage (SkyRL's trainer gathers log-probs from the
    last stage and sends the whole batch to every rank)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return t.float().contiguous()
    # on the rank's device: NCCL broadcasts only GPU tensors; the caller compares on the host
    dev = train_device()
    buf = t.float().to(dev).contiguous() if ps.is_pipeline_last_stage(ignore_virtual=True) else torch.zeros(shape, device=dev)
    torch.distributed.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return buf.cpu()


def run_steps(ctx: Any, spec: Any, step: StepSpec, rollouts: Sequence[CanonicalRollout]) -> dict:
    """Train ``len(rollouts)`` steps (compute_log_prob, R2 write-back, one update, optimizer step)
    through SkyRL's wrapper with r3bridge's adapter, under the routing probe. Picklable result."""
    from megatron.core import parallel_state as ps

    from r3bridge.adapters.skyrl import PolicyWorkerMixin, SkyRLCodec
    from r3bridge.adapters.skyrl.handles import RouteWriter
    from r3bridge.adapters.skyrl.hooks import RECORDED_KEY
    from r3bridge.config import ReplayConfig
    from r3bridge.hf import ModelInfo
    from r3bridge.testing.harness.models import build_model_chunks
    from r3bridge.testing.harness.probe import RoutingProbe
    from testlab.dispatch_records import DispatchLog

    chunks = build_model_chunks(spec, ctx)
    if step.remove_microbatch_padding:
        for c in chunks:       # SkyRL's THD path feeds position_ids=None (its models use RoPE); the harness
            emb = getattr(c, "embedding", None)      # GPT has learned absolute positions: switched off
            if emb is not None:
                emb.add_position_embedding = False
    cfg_mod = _skyrl("skyrl.train.config")
    cfg = cfg_mod.TrainerConfig()
    cfg.remove_microbatch_padding = step.remove_microbatch_padding
    cfg.micro_forward_batch_size_per_gpu = step.micro_forward_batch_size
    cfg.micro_train_batch_size_per_gpu = step.micro_train_batch_size
    cfg.algorithm.temperature = 1.0
    cfg.policy.optimizer_config.lr = step.lr
    # the documented SkyRL settings: R3 turns megatron's replay flag on (SkyRL's config check wants
    # it with routed experts; PolicyWorkerMixin keeps it off in the model), R2 leaves it off
    cfg.policy.megatron_config.moe_enable_routing_replay = step.mode == "R3"
    mc = chunks[0].config
    moe = [i for i in range(mc.num_layers) if (mc.moe_layer_freq[i] if isinstance(mc.moe_layer_freq, list)
                                                else i % mc.moe_layer_freq == 0)]
    hf = {"num_hidden_layers": mc.num_layers, "num_experts": mc.num_moe_experts,
          "num_experts_per_tok": mc.moe_router_topk, "mlp_only_layers": [i for i in range(mc.num_layers) if i not in moe]}
    worker_cls = type("HarnessPolicyWorker", (PolicyWorkerMixin, PolicyWorkerStandIn),
                      {"r3_config": ReplayConfig(replay_mode=step.mode, trace_dir=step.trace_dir,
                                                 route_transport=step.route_transport)})
    w = worker_cls(cfg, chunks, hf)
    w.init_model()
    if ctx.vpp:
        mc.microbatch_group_size_per_vp_stage = ctx.pp
    layout = ParallelLayout.from_megatron(mc)
    codec = SkyRLCodec(num_experts=mc.num_moe_experts, moe_layer_ids=moe, num_hidden_layers=mc.num_layers)
    writer = None
    if step.route_transport == "handles":      # what TrainerMixin does in SkyRL's driver (one writer per job)
        writer = RouteWriter(w.r3_config, **({"directory": step.routes_dir} if step.routes_dir else {}))
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    recompute = mc.recompute_granularity is not None
    results = []
    log = DispatchLog("skyrl")
    for s, rollout in enumerate(rollouts):
        batch = training_input(rollout, seed=s)
        if step.mode == "R2":       # generator.inference_engine.enable_return_routed_experts=False
            batch["rollout_expert_indices"] = None
            if "router_padding_mask" in batch:
                batch["router_padding_mask"] = None
        elif writer is not None:    # TrainerMixin.convert_to_training_input: written once, handles in the batch
            writer.write_rollout(batch, generator_routes(rollout), batch.metadata["uids"], step=s,
                                 model=ModelInfo.from_hf_config(hf))
        b, a = batch["sequences"].shape[0], batch.metadata["response_length"]
        seq_lens = batch["attention_mask"].sum(-1).tolist()
        res: dict[str, Any] = {"step": s}

        with RoutingProbe(chunks, include_mtp=False) as probe, PackingNotes(chunks) as notes:
            out = w.forward(batch)
        fwd_calls, fwd_notes = list(probe.calls), notes.notes
        lp = _from_last_stage(torch.tensor([o["logprobs"] for o in out.loss_fn_outputs]) if last else None, (b, a))
        fwd_groups = _groups(range(b), step.micro_forward_batch_size)
        log_dispatch(ctx, log, s, "compute_log_prob", fwd_calls, fwd_notes, fwd_groups, seq_lens, layout)
        if step.mode == "R3":
            expected = rollout.expected()
        elif step.mode == "R2":
            outs = out.loss_fn_outputs
            recorded = ReplayBatch.concat([ReplayBatch.from_bytes(o[RECORDED_KEY]) for o in outs]) if last else None
            recorded = _broadcast_obj(recorded)
            if writer is not None:                        # TrainerMixin with handles: written once
                writer.write_recorded(batch, recorded, batch.metadata["uids"], step=s)
            else:
                codec.write_recorded(batch, recorded)        # what TrainerMixin does with them
            expected = recorded
            res["recorded_rows"] = recorded.rows_per_seq
            res["recorded"] = recorded.to_bytes()       # what the update had to replay (for dispatch checks)
        else:
            expected = None
        if expected is not None:
            bad: list[int] = []
            res["fwd_errors"], res["fwd_checked"] = check_router_calls(
                ctx, fwd_calls, fwd_notes, fwd_groups, seq_lens, expected, layout, passes={False}, mismatched=bad)
            res["fwd_mismatched"] = sum(bad)
        res["fwd_metrics"] = dict(w.model.r3.metrics)

        batch["action_log_probs"] = lp
        batch["base_action_log_probs"] = lp.clone()
        order = list(step.permute) if step.permute else list(range(b))
        upd = _reindexed(batch, order)
        with RoutingProbe(chunks, include_mtp=False) as probe, PackingNotes(chunks) as notes:
            out2 = w.forward_backward(upd)
        log_dispatch(ctx, log, s, "update", probe.calls, notes.notes, _groups(order, step.micro_train_batch_size),
                     seq_lens, layout)
        if expected is not None:
            passes = {False, True} if recompute else {True}
            bad = []
            res["upd_errors"], res["upd_checked"] = check_router_calls(
                ctx, probe.calls, notes.notes, _groups(order, step.micro_train_batch_size), seq_lens, expected,
                layout, passes=passes, mismatched=bad)
            res["upd_mismatched"] = sum(bad)
        res["upd_metrics"] = dict(w.model.r3.metrics)
        res["logged"] = {k: v for k, v in out2.metrics["micro_batches"][0].items() if k != "loss_fn_outputs"}
        if last:   # the update's log-probs (same weights, same routes) against compute_log_prob's
            diffs = []
            for pos, i in enumerate(order):
                got = torch.tensor(out2.loss_fn_outputs[pos]["logprobs"])
                diffs.append(float((got - lp[i, a - got.numel():]).abs().max()) if got.numel() else 0.0)
            res["max_logprob_diff"] = max(diffs)
        res["grad_norm"] = w.optim_step()
        if writer is not None:      # TrainerMixin.train_critic_and_policy's end: the step's routes go
            res["stored_files"] = _files(writer.directory, writer.store.run_id)
            res["released"] = writer.release(s)
            res["files_after_release"] = _files(writer.directory, writer.store.run_id)
        results.append(res)
    return {"pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank, "steps": results, "dispatch": log.records()}


def _files(directory: Optional[str], run_id: str) -> int:
    """Route files a run holds (route_store a folder)."""
    import os

    return sum(len(f) for _, _, f in os.walk(os.path.join(directory, run_id))) if directory else 0


def _broadcast_obj(obj: Any) -> Any:
    """The last pipeline stage's object on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return box[0]
