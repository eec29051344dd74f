"""P3: step overhead of R3 replay on one GPU (bf16), measured side by side with native routing.

    python benchmarks/p3_step_overhead.py [--spec local|te] [--route-sets 4] [--layers 8 --hidden 2048
                                           --experts 64 --topk 8 --seqs 4 --seq-len 2048 --iters 12]
                                           [--profile] [--json]

Model: megatron-core GPTModel, every layer MoE, alltoall dispatcher, bf16, on either layer spec:

* ``--spec te``: Transformer Engine's (TE attention on packed THD input, TEGroupedMLP), what
  production jobs build; one packed micro-batch of ``seqs x seq_len`` tokens;
* ``--spec local``: megatron-core's torch modules (SequentialMLP); local attention refuses THD, so
  the same tokens go in as BSHD (b = seqs) with a causal mask.

``--route-sets N`` token batches are drawn and each one's routes recorded once (R2 record, last
token of each sequence dropped as the engines do). Step ``i`` of every arm runs batch ``i % N``,
so native routing and replay see the same tokens and the same expert loads:

* native: no replay object attached;
* r3: r3bridge.megatron.Replayer step replaying batch ``i % N``'s recorded routes, targets
  installed per step (shard + H2D copy included in the timing), agreement metric off;
* r3+agreement: the same with the per-layer native-vs-replayed agreement computed in the hook;
* r3+trace: r3+agreement through :class:`r3bridge.session.PhaseRunner` with ``trace_dir`` set
  (the ``trace_dir`` option as a job sets it: the native top-k and the target kept on the device
  per router call, then each pass written: two CRC-checked payloads and an index line); its cost
  is read against r3+agreement, which computes the same native top-k;
* r3_one_set: replaying batch 0's routes on batch 0 every step, what P3 measured before
  2026-11-25: with one fixed route set the grouped GEMMs and the dispatcher see the same expert
  loads every step, a cache effect that made "R3" look 4-65% faster than native routing
  (field notes 12 and 14). It is reported to show that artifact, not as replay's cost.

Arms are interleaved per step, in an order that rotates every step, so clock drift and position
effects hit all alike. ``--profile`` adds, per arm, the
GPU kernels that took the most time in one profiled step (torch.profiler). Also reported: the
replay memory held per in-flight micro-batch against the budget ``local layers x local rows x K x 8``
bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def build(args):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    te = args.spec == "te"
    if te:
        from r3bridge.testing.harness.models import require_te
        require_te()
    # megatron-core 0.16.1 without Transformer Engine: the router references te_general_gemm,
    # a name only defined when TE imports (docs/testing-harness.md).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=16, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, moe_grouped_gemm=te,
        moe_permute_fusion=False, moe_router_fusion=False, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        variable_seq_lengths=True)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=te)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=32000,
                     max_sequence_length=args.seq_len, position_embedding_type="rope")
    # local-spec norms are torch LayerNorms created in fp32; Float16Module would cast them
    model = model.to(device="cuda", dtype=torch.bfloat16)
    return cfg, model


class Inputs:
    """One token batch in the layout the spec takes: packed THD (TE) or BSHD + causal mask (local)."""

    def __init__(self, args, seed: int) -> None:
        b, s = args.seqs, args.seq_len
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = [s] * b
        self.te = args.spec == "te"
        tokens = torch.randint(0, 32000, (b, s), generator=g).cuda()
        if self.te:
            from megatron.core.packed_seq_params import PackedSeqParams

            self.cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
            self.tokens = tokens.reshape(1, b * s)
            self.pos = torch.arange(s, device="cuda").repeat(b).unsqueeze(0)
            self.mask = None
            self.psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu,
                                       cu_seqlens_q_padded=self.cu, cu_seqlens_kv_padded=self.cu,
                                       max_seqlen_q=s, max_seqlen_kv=s)
        else:
            self.tokens = tokens
            self.pos = torch.arange(s).expand(b, s).cuda()
            self.mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s).cuda()
            self.psp = None

    def install(self, step, model, routes) -> None:
        if self.te:
            step.install(model, routes, self.seq_lens, format="thd", cu_seqlens_padded=self.cu.cpu())
        else:
            step.install(model, routes, self.seq_lens, format="bshd", seq_length=self.seq_lens[0])

    def micro_batch(self, routes):
        """The same install as an adapter hands it to ``ReplayPass.install``."""
        from r3bridge.megatron import MicroBatch

        if self.te:
            return MicroBatch(self.seq_lens, routes, format="thd", cu_seqlens_padded=self.cu.cpu())
        return MicroBatch(self.seq_lens, routes, format="bshd", seq_length=self.seq_lens[0])

    def forward(self, model, labels: bool = True):
        kw = {"labels": self.tokens} if labels else {}
        return model(self.tokens, self.pos, self.mask, packed_seq_params=self.psp, **kw)


def _gpu_total_ms(prof) -> float:
    """The step's GPU time: every op's *self* device time (kernels counted once), in ms."""
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        total += float(t or 0.0)
    return round(total / 1000.0, 3)


def _top_kernels(prof, n: int = 8) -> list[tuple[str, float]]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            rows.append((e.key[:90], round(float(t) / 1000.0, 3)))     # ms
    return sorted(rows, key=lambda r: -r[1])[:n]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", choices=["local", "te"], default="te")
    p.add_argument("--route-sets", type=int, default=4, help="token batches / recorded route sets cycled through")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--expert-ffn", type=int, default=1024)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import shutil
    import tempfile

    import r3bridge
    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import Replayer
    from r3bridge.session import PhaseRunner

    cfg, model = build(args)
    b = args.seqs
    layers = list(range(args.layers))
    sets = [Inputs(args, seed) for seed in range(args.route_sets)]
    routes = []
    rec_rep = Replayer([model], agreement=False)
    for inp in sets:
        with torch.no_grad(), rec_rep.open_pass("record", forward_only=True) as rs:
            inp.install(rs, model, None)
            inp.forward(model, labels=False)
        recorded = rs.recorded
        routes.append(r3bridge.ReplayBatch.from_ragged([recorded.sequence(i)[0][:-1] for i in range(b)],
                                                       num_experts=args.experts, layer_ids=layers, engine="vllm"))
    rec_rep.detach()

    def fwd_bwd(inp):
        out = inp.forward(model)
        out.float().mean().backward()

    state = {"rep": Replayer([model], agreement=False)}

    def native(k):
        fwd_bwd(sets[k])

    def replay(k, agreement):
        rep = state["rep"]
        rep.agreement = agreement
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            sets[k].install(st, model, routes[k])
            fwd_bwd(sets[k])

    trace_dir = tempfile.mkdtemp(prefix="r3b_p3_trace_")
    traced = PhaseRunner(None, ReplayConfig(replay_mode="R3", trace_dir=trace_dir), framework="p3")
    written = []

    def replay_traced(k):
        rep = state["rep"]
        rep.agreement = True
        traced.replayer = rep                  # the arm's runner follows the (re-attached) replayer
        with traced.run(Phase.UPDATE, forward_only=False) as ps:
            ps.install(model, sets[k].micro_batch(routes[k]))
            fwd_bwd(sets[k])
        written.append(ps.result.metrics.get("r3bridge/trace/bytes", 0.0))

    variants = {
        "native": native,
        "r3": lambda k: replay(k, False),
        "r3+agreement": lambda k: replay(k, True),
        "r3+trace": replay_traced,
        "r3_one_set": lambda k: replay(0, False),
    }

    def run(name, k):
        if name == "native":
            state["rep"].detach()
        elif not any(r.router_replay is not None for r in state["rep"].chunks[0].routers.values()):
            state["rep"] = Replayer([model], agreement=False)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        variants[name](k)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = {k: [] for k in variants}
    names = list(variants)
    for it in range(args.warmup + args.iters):
        # the arms' order rotates every step: no arm always runs first (after another's backward)
        for name in names[it % len(names):] + names[:it % len(names)]:
            dt = run(name, it % args.route_sets)
            if it >= args.warmup:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    mins = {k: min(v) for k, v in times.items()}
    profile, gpu_ms = {}, {}
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        for name in variants:
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(name, 1 % args.route_sets)
            profile[name] = _top_kernels(prof)
            gpu_ms[name] = _gpu_total_ms(prof)
    seq_lens = sets[0].seq_lens
    if args.spec == "te":
        t = r3bridge.shard(routes[0], state["rep"].layout, seq_lens, format="thd",
                           cu_seqlens_padded=sets[0].cu.cpu(), device="cuda")
    else:
        t = r3bridge.shard(routes[0], state["rep"].layout, seq_lens, format="bshd", seq_length=args.seq_len,
                           device="cuda")
    rows = t.num_rows
    budget = len(layers) * rows * args.topk * 8
    held = sum(x.numel() * x.element_size() for x in t.indices.values())
    res = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "transformer_engine": _te_version(), "shape": vars(args), "median_s": med, "min_s": mins,
        "overhead_r3": med["r3"] / med["native"] - 1, "overhead_r3_agreement": med["r3+agreement"] / med["native"] - 1,
        "overhead_r3_min": mins["r3"] / mins["native"] - 1,
        # the trace's cost on top of the agreement metric (which computes the same native top-k)
        "overhead_trace_vs_agreement": med["r3+trace"] / med["r3+agreement"] - 1,
        "overhead_trace_vs_agreement_min": mins["r3+trace"] / mins["r3+agreement"] - 1,
        "overhead_r3_trace": med["r3+trace"] / med["native"] - 1,
        # trace/bytes is the run's running total: per pass, the last total over the passes written
        "trace_bytes_per_pass": written[-1] / len(written) if written else 0.0,
        "one_route_set_artifact": med["r3_one_set"] / med["native"] - 1,
        "replay_bytes_per_microbatch": held, "valid_mask_bytes": t.valid.numel(), "budget_bytes": budget,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
    }
    shutil.rmtree(trace_dir, ignore_errors=True)
    if profile:
        res["top_kernels_ms"] = profile
        res["gpu_time_ms_one_step"] = gpu_ms
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")


def _te_version():
    try:
        import transformer_engine
    except ImportError:
        return None
    return str(transformer_engine.__version__)


if __name__ == "__main__":
    main()
