"""Forward step, pipeline schedule and optimizer helpers for harness models.

``run_schedule`` drives megatron's own ``get_forward_backward_func()`` (no pipelining /
1F1B / interleaved, chosen from parallel state), so routers are called exactly as in a
production step. Gradients are plain ``param.grad`` (no megatron DDP wrapper);
``sync_grads`` does the reductions that megatron's DDP + ``finalize_model_grads`` would do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch

from r3bridge.testing.harness.data import (
    PackedBatch,
    cp_zigzag_index,
    local_inputs,
    packed_causal_mask,
    packed_seq_params,
)

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.testing.harness.dist import RankContext

ForwardStepFunc = Callable[[Iterator[PackedBatch], torch.nn.Module], tuple[Any, Callable[..., Any]]]


@dataclass
class MicroBatchResult:
    """What the last pipeline stage reports for one micro-batch (other stages get none)."""

    loss: float  # masked token-mean CE over the whole (un-split) micro-batch
    logits: Optional[torch.Tensor] = None  # [T, vocab] in packed order, if collected
    extra: dict[str, Any] = field(default_factory=dict)


def _gather_logits(local: torch.Tensor, batch: PackedBatch, ctx: "RankContext") -> torch.Tensor:
    """[s_local, 1, V/tp] vocab-parallel logits -> full [T, V] in packed order (TP+CP gather)."""
    from megatron.core import parallel_state as ps

    x = local.detach().squeeze(1)  # [n, V/tp]
    if ctx.tp > 1:
        parts = [torch.empty_like(x) for _ in range(ctx.tp)]
        torch.distributed.all_gather(parts, x.contiguous(), group=ps.get_tensor_model_parallel_group())
        x = torch.cat(parts, dim=-1)
    if ctx.cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.cp)]
    torch.distributed.all_gather(parts, x.contiguous(), group=ps.get_context_parallel_group())
    full = torch.empty(batch.total, x.shape[-1], dtype=x.dtype, device=x.device)
    for r, part in enumerate(parts):
        full[cp_zigzag_index(batch.padded_lens, ctx.cp, r)] = part
    return full


def make_forward_step(
    ctx: "RankContext", *, thd: bool, collect_logits: bool = False
) -> ForwardStepFunc:
    """A megatron ``forward_step_func`` for iterators of un-split :class:`PackedBatch`.

    ``thd=True`` (identity attention): packed input with ``PackedSeqParams``, any CP.
    ``thd=False`` (real attention): local ``DotProductAttention`` rejects packed_seq_params,
    so the packed stream is fed as BSHD with b = 1 and a block-diagonal causal mask per
    padded sequence (same attention as THD; router rows identical); CP is impossible there
    (only TE attention implements CP).

    The loss returned to the schedule is ``sum(local CE * mask) / n_valid_global / cp``;
    megatron multiplies it by cp and divides by the micro-batch count, so summing gradients
    over CP (``sync_grads``) yields the exact gradient of the mean over all valid tokens.
    """
    if not thd and ctx.cp > 1:
        raise ValueError("CP needs attention='identity' (thd) on CPU: local attention has no CP")

    def forward_step(data_iterator: Iterator[PackedBatch], model: torch.nn.Module) -> tuple[Any, Any]:
        batch = next(data_iterator)
        loc = local_inputs(batch, ctx.cp, ctx.cp_rank)
        captured: list[torch.Tensor] = []
        handle = None
        if collect_logits and getattr(model, "post_process", False):
            # The main logits are the output layer's *last* call (MTP heads call it first).
            # Cloned: megatron's vocab-parallel cross entropy works in place on the logits.
            handle = model.output_layer.register_forward_hook(  # type: ignore[union-attr]
                lambda _m, _i, out: captured.append(out[0].detach().clone())
            )
        try:
            output = model(
                loc["input_ids"],
                loc["position_ids"],
                None if thd else packed_causal_mask(batch).to(loc["input_ids"].device),
                labels=loc["labels"],
                loss_mask=loc["loss_mask"],
                packed_seq_params=packed_seq_params(batch) if thd else None,
            )
        finally:
            if handle is not None:
                handle.remove()
        n_global = batch.loss_mask.sum().clamp(min=1.0)

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss_sum = (per_token.float() * loc["loss_mask"]).sum()
            reduced: dict[str, Any] = {"loss_sum": loss_sum.detach(), "n_global": n_global}
            if captured:
                reduced["logits"] = _gather_logits(captured[-1], batch, ctx)
            return loss_sum / n_global / ctx.cp, reduced

        return output, loss_func

    return forward_step


def run_schedule(
    chunks: list[torch.nn.Module],
    micro_batches: Sequence[PackedBatch],
    forward_step_func: ForwardStepFunc,
    *,
    forward_only: bool,
    seq_length: Optional[int] = None,
    micro_batch_size: int = 1,
) -> list[MicroBatchResult]:
    """Run one megatron schedule over ``micro_batches``; per-micro-batch results on the
    last pipeline stage (``[]`` elsewhere).

    ``seq_length`` is the un-split packed length used for p2p shapes (default: the longest
    micro-batch). With pp > 1 and without ``variable_seq_lengths`` (allgather dispatcher)
    every micro-batch must have exactly that length. Forward-only runs under ``torch.no_grad()`` (as a log-prob
    pass does); module train/eval modes are left as the caller set them.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = chunks[0].config  # type: ignore[union-attr]
    lengths = [b.total for b in micro_batches]
    if seq_length is None:
        seq_length = max(lengths)
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1 and not config.variable_seq_lengths and any(n != seq_length for n in lengths):
        raise ValueError(
            f"micro-batch lengths {lengths} must all equal seq_length={seq_length} without "
            "variable_seq_lengths (allgather dispatcher); use make_packed_batch(pad_to=...)"
        )
    m = len(micro_batches)
    if len(chunks) > 1:
        # Interleaved schedule: group size must be in [pp, M] and M % group must be 0 or >= pp.
        g = pp if (m % pp == 0 or m % pp >= pp) else m
        config.microbatch_group_size_per_vp_stage = g
    config.finalize_model_grads_func = None  # grads are reduced by sync_grads()
    config.grad_scale_func = None
    fb = get_forward_backward_func()
    iters: Any = [iter(list(micro_batches)) for _ in chunks]
    with torch.no_grad() if forward_only else torch.enable_grad():
        store = fb(
            forward_step_func=forward_step_func,
            data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=m,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    out: list[MicroBatchResult] = []
    for item in store:
        loss_sum = item["loss_sum"].clone()
        if ps.get_context_parallel_world_size() > 1:
            torch.distributed.all_reduce(loss_sum, group=ps.get_context_parallel_group())
        out.append(
            MicroBatchResult(loss=float(loss_sum / item["n_global"]), logits=item.get("logits"))
        )
    return out


# --------------------------------------------------------------------------------------------
# Gradients and optimizer
# --------------------------------------------------------------------------------------------


def _params(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [p for c in chunks for p in c.parameters()]


def zero_grads(chunks: Sequence[torch.nn.Module]) -> None:
    for p in _params(chunks):
        p.grad = None


def _all_reduce_grads(params: list[torch.nn.Parameter], group: Any, scale: float = 1.0) -> None:
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    flat *= scale
    off = 0
    for p in params:
        n = p.numel()
        p.grad = flat[off : off + n].view_as(p).clone()
        off += n


@torch.no_grad()
def sync_grads(chunks: Sequence[torch.nn.Module], ctx: "RankContext") -> None:
    """The gradient reductions of megatron's DDP + finalize_model_grads, on plain ``.grad``.

    Convention: the loss is the mean over DP ranks of each sample's token-mean loss; CP ranks
    hold disjoint tokens of one sample (see make_forward_step), so they are summed.

    1. params marked ``sequence_parallel`` (norms and routers under SP): sum over TP;
    2. word/position embedding copies on the first and last stage (MTP with PP > 1): sum over
       the embedding group;
    3. dense params: sum over DP x CP, then / dp;
    4. expert params (found by name): sum over the expert-data-parallel group, then / dp.
       megatron's DDP picks experts by ``allreduce=False``, which it only sets when EP > 1;
       with EP = 1 and ETP < TP it would reduce experts over DP x CP only, although every TP
       rank routed a different sequence shard through its expert replica. Reducing over the
       expert-DP group gives the exact gradient in every layout (identical when ETP == TP).
    """
    from megatron.core import parallel_state as ps

    from r3bridge.testing.harness.models import is_expert_param

    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    if ctx.tp > 1:
        sp = [p for _, p in named if getattr(p, "sequence_parallel", False)]
        _all_reduce_grads(sp, ps.get_tensor_model_parallel_group())
    if ctx.pp > 1 and chunks[0].config.mtp_num_layers and ps.is_rank_in_embedding_group():  # type: ignore[union-attr]
        holder = chunks[0] if ps.is_pipeline_first_stage() else chunks[-1]
        emb = [p for _, p in sorted(holder.embedding.named_parameters())]  # type: ignore[union-attr]
        _all_reduce_grads(emb, ps.get_embedding_group())
    dense = [p for n, p in named if not is_expert_param(n)]
    expert = [p for n, p in named if is_expert_param(n)]
    _all_reduce_grads(dense, ps.get_data_parallel_group(with_context_parallel=True), 1.0 / ctx.dp)
    _all_reduce_grads(expert, ps.get_expert_data_parallel_group(), 1.0 / ctx.dp)


def make_optimizer(
    chunks: Sequence[torch.nn.Module], *, kind: str = "sgd", lr: float = 1e-2
) -> torch.optim.Optimizer:
    """Plain torch optimizer over all chunk parameters (no distributed optimizer)."""
    params = _params(chunks)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer kind {kind!r}")


def optimizer_step(
    chunks: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, ctx: "RankContext"
) -> None:
    """sync_grads, step, zero grads."""
    sync_grads(chunks, ctx)
    optimizer.step()
    zero_grads(chunks)
