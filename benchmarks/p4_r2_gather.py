"""P4: R2 gather of recorded routes over 4 pipeline stages, r3bridge vs verl 0.9.1.

    python benchmarks/p4_r2_gather.py [--device cpu|cuda] [--seqs 16 --mean-len 4096 --layers 48
                                       --topk 8 --experts 128 --repeats 5] [--json]

``--device cpu`` (default): 4 gloo processes. ``--device cuda``: 4 NCCL processes, one GPU each;
the recorded routes start on the GPU as the routers produced them, verl's inputs on the CPU where
its ``merge_router_topk_indices`` leaves them (``.cpu()``), exactly as in a verl R2 step.

Same inputs on every side: each of 4 PP ranks holds the routes its 12 MoE layers recorded for a
micro-batch of 16 sequences (lengths around 4096).

* verl: ``verl.utils.megatron.router_replay_utils.pp_gather`` on verl's own layouts: a nested
  jagged int16 tensor ``[bs, seq_i, local_layers, K]`` (pickled through ``all_gather_object``) and
  the dense padded ``[bs, max_len, local_layers, K]`` int16 tensor (padded all_gather);
* r3bridge: ``r3bridge.megatron.recorder.gather_recorded``: each stage stacks its layers' compact
  uint8 ids token-major, one tensor all-gather, then one pass (``assemble_gathered``: one plan, a few
  row-block copies) into a per-sample ReplayBatch (the complete R2 result, sequences in sample order).

``--pp 1`` runs on one GPU: no transport (the floor is a one-rank all_gather), so it measures only
each side's work around it.

Reported: median wall time per gather on rank 0 (barrier to barrier) and ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def rank_fn(ctx, args):
    import torch.distributed as dist
    from _common import load_verl_router_replay_utils
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    rru = load_verl_router_replay_utils()
    # verl picks its device once at import; under the harness's CPU shim it says "cuda"
    rru.device_name = args.device
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    from r3bridge.layout import ParallelLayout
    from r3bridge.megatron.installed import InstalledMicroBatch
    from r3bridge.megatron.recorder import gather_recorded
    from r3bridge.schema import route_dtype

    pp, k = args.pp, args.topk
    g = torch.Generator().manual_seed(0)           # same lengths on every rank
    lens = (torch.full((args.seqs,), args.mean_len) + torch.randint(-512, 513, (args.seqs,), generator=g)).tolist()
    layout = ParallelLayout(num_layers=args.layers, pp=pp)
    local = layout.moe_layers(ctx.pp_rank)
    total, max_len = sum(lens), max(lens)
    g.manual_seed(1 + ctx.pp_rank)                 # each stage's routes differ
    routes = torch.rand((total, len(local), args.experts), generator=g).topk(k, -1).indices  # [T, l, K] int64
    # What a router leaves after a RECORD forward: its own int64 top-k [T, K], on its device.
    router_idx = [routes[:, j].contiguous().to(dev) for j in range(len(local))]

    # verl's side. Its R2 path per micro-batch: merge_router_topk_indices (stack the routers'
    # recorded ids, SP gather, unpack THD into a nested per-sample tensor, .cpu()); per
    # mini-batch: merge_nested_router_maps, then pp_gather. RouterReplay is verl's own class.
    tf = TransformerConfig(num_layers=args.layers, hidden_size=64, num_attention_heads=4, num_moe_experts=args.experts,
                           moe_router_topk=k, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                           use_cpu_initialization=True)
    rru.RouterReplay.router_instances.clear()
    for idx in router_idx:
        rru.RouterReplay().record_indices(idx)
    input_ids = torch.nested.as_nested_tensor([torch.randint(0, 1000, (n,), generator=g) for n in lens],
                                              layout=torch.jagged).to(dev)

    def verl_r2_path():
        per_mb: list = []
        rru.merge_router_topk_indices(None, input_ids, per_mb, tf, 0)
        return rru.pp_gather(rru.merge_nested_router_maps(per_mb), tf)

    # verl's last step alone, on the CPU tensors merge_router_topk_indices leaves
    per_seq = list(routes.split(lens))
    nested = torch.nested.as_nested_tensor([r.to(torch.int16) for r in per_seq], layout=torch.jagged)
    dense = torch.zeros((args.seqs, max_len, len(local), k), dtype=torch.int16)
    for i, r in enumerate(per_seq):
        dense[i, : r.shape[0]] = r.to(torch.int16)

    # r3bridge's side: the hook narrows each router's ids as it records (step.py), then
    # gather_recorded does TP/CP/PP all-gathers and one pass into a per-sample ReplayBatch.
    groups = {"pp": ps.get_pipeline_model_parallel_group(), "tp": None, "cp": None}
    narrow = route_dtype(args.experts)

    def r3bridge_path():
        mb = InstalledMicroBatch(0, 0, total, total, lens, dict(format="thd", cu_seqlens_padded=None, seq_length=None),
                        list(range(args.seqs)),
                        recorded={lid: router_idx[j].to(narrow) for j, lid in enumerate(local)})
        return gather_recorded([mb], layout=layout, chunk_layer_ids=[local], pp_rank=ctx.pp_rank, groups=groups,
                               num_experts=args.experts, topk=k, device=dev)

    payload = routes.to(narrow).permute(1, 0, 2).contiguous().reshape(-1).view(torch.uint8).to(dev)

    def floor_all_gather():   # the transport alone: r3bridge's payload, one all_gather, no unpacking
        parts = [torch.empty_like(payload) for _ in range(pp)]
        dist.all_gather(parts, payload, group=groups["pp"])
        return parts

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    variants = {"floor_all_gather": floor_all_gather,
                "verl_pp_gather_only_nested": lambda: rru.pp_gather(nested, tf),
                "verl_pp_gather_only_dense": lambda: rru.pp_gather(dense, tf),
                "verl_r2_path": verl_r2_path,
                "r3bridge_gather_recorded": r3bridge_path}
    times: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    for _ in range(args.repeats + 1):
        for name, fn in variants.items():
            sync()
            t0 = time.perf_counter()
            results[name] = fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    # Every rank ends with the whole batch; both sides must hold the same per-sample routes.
    rb, theirs = results["r3bridge_gather_recorded"], results["verl_r2_path"]
    ours = [rb.sequence(i)[0].to(torch.int64) for i in range(rb.num_seqs)]
    same = all(torch.equal(a, b.to(torch.int64)) for a, b in zip(ours, theirs.unbind()))
    ok = (rb.num_seqs == args.seqs and rb.rows_per_seq == lens and rb.layer_ids == tuple(layout.moe_layer_ids)
          and torch.equal(rb.with_layers(local).routes, routes.to(narrow)) and same)
    return {name: statistics.median(v[1:]) for name, v in times.items()} | {"result_ok": ok}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--mean-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (one process each)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from r3bridge.testing.dist import spawn

    res = spawn(rank_fn, world_size=args.pp, pp=args.pp, args=(args,), timeout=1200,
                backend="nccl" if args.device == "cuda" else "gloo")[0]
    r3 = res["r3bridge_gather_recorded"]
    out = {"median_s": {k: v for k, v in res.items() if k != "result_ok"}, "result_ok": res["result_ok"],
           "speedup_vs_verl_r2_path": res["verl_r2_path"] / r3,
           "speedup_vs_verl_pp_gather_only_nested": res["verl_pp_gather_only_nested"] / r3,
           "speedup_vs_verl_pp_gather_only_dense": res["verl_pp_gather_only_dense"] / r3,
           "r3bridge_over_floor": r3 / res["floor_all_gather"], "shape": vars(args),
           "machine": (f"{args.pp} x {torch.cuda.get_device_name(0)}, NCCL, torch {torch.__version__}"
                       if args.device == "cuda" else
                       f"{args.pp} gloo processes, {os.cpu_count()} CPUs, torch {torch.__version__}")}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
