"""P3: step overhead of R3 replay on one GPU (bf16), measured side by side with native routing.

    python benchmarks/p3_step_overhead.py [--layers 8 --hidden 2048 --experts 64 --topk 8
                                           --seqs 4 --seq-len 4096 --iters 10] [--json]

Model: megatron-core GPTModel, local (non-TE) spec with real attention, every layer MoE, alltoall
dispatcher, bf16. One micro-batch of ``seqs x seq_len`` tokens (BSHD, b = seqs). Per iteration:
forward + backward. Variants, interleaved per iteration so clock drift hits all alike:

* native: no replay object attached;
* r3: r3bridge.megatron.Replayer step, targets installed per micro-batch (shard + H2D copy
  included in the timing), agreement metric off;
* r3+agreement: the same with the per-layer native-vs-replayed agreement computed in the hook.

Also reports the replay memory held per in-flight micro-batch against the budget
``local layers x local rows x K x 8`` bytes.
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

    # megatron-core 0.16.1 without Transformer Engine: the router references te_general_gemm,
    # a name only defined when TE imports (docs/testing-harness.md). The device image has no TE.
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
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, moe_grouped_gemm=False,
        moe_permute_fusion=False, moe_router_fusion=False, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        variable_seq_lengths=True)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=32000,
                     max_sequence_length=args.seq_len, position_embedding_type="rope")
    # local-spec norms are torch LayerNorms created in fp32; Float16Module would cast them
    model = model.to(device="cuda", dtype=torch.bfloat16)
    return cfg, model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--expert-ffn", type=int, default=1024)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import r3bridge
    from r3bridge.megatron import Replayer

    cfg, model = build(args)
    b, s = args.seqs, args.seq_len
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32000, (b, s), generator=g).cuda()
    pos = torch.arange(s).expand(b, s).cuda()
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s).cuda()
    layers = list(range(args.layers))
    # Replay the model's own routes (recorded once, last token of each sequence dropped as the
    # engines do): the experts then see exactly the native token distribution, so the timing
    # difference is the replay machinery alone, not a different expert load.
    rec_rep = Replayer([model], agreement=False)
    with torch.no_grad(), rec_rep.step("record", forward_only=True) as rs:
        rs.install(model, None, [s] * b, format="bshd", seq_length=s)
        model(tokens, pos, mask)
    rec_rep.detach()
    recorded = rs.recorded
    rb = r3bridge.ReplayBatch.from_ragged([recorded.sequence(i)[0][:-1] for i in range(b)],
                                          num_experts=args.experts, layer_ids=layers, source="vllm")

    def fwd_bwd():
        out = model(tokens, pos, mask, labels=tokens)
        out.float().mean().backward()

    def native():
        fwd_bwd()

    rep = Replayer([model], agreement=False)
    rep_agree_flag = {"on": False}

    def r3():
        rep.agreement = rep_agree_flag["on"]
        with rep.step("replay", forward_only=False, source="rollout") as st:
            st.install(model, rb, [s] * b, format="bshd", seq_length=s)
            fwd_bwd()
        return st

    variants = {"native": native, "r3": r3, "r3+agreement": r3}
    times = {k: [] for k in variants}
    for it in range(args.warmup + args.iters):
        for name, fn in variants.items():
            rep_agree_flag["on"] = name == "r3+agreement"
            if name == "native":
                rep.detach()
            elif not any(r.router_replay is not None for r in rep.chunks[0].routers.values()):
                rep = Replayer([model], agreement=False)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    t = r3bridge.shard(rb, rep.layout, [s] * b, format="bshd", seq_length=s, device="cuda")
    rows = t.num_rows
    budget = len(layers) * rows * args.topk * 8
    held = sum(x.numel() * x.element_size() for x in t.indices.values())
    res = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "shape": vars(args), "median_s": med,
        "overhead_r3": med["r3"] / med["native"] - 1, "overhead_r3_agreement": med["r3+agreement"] / med["native"] - 1,
        "replay_bytes_per_microbatch": held, "valid_mask_bytes": t.valid.numel(), "budget_bytes": budget,
    }
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
