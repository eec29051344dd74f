"""P4: R2 gather of recorded routes over 4 pipeline stages (CPU, gloo), r3bridge vs verl 0.9.1.

    python benchmarks/p4_r2_gather.py [--seqs 16 --mean-len 4096 --layers 48 --topk 8 --experts 128
                                       --repeats 5] [--json]

Same inputs on every side: each of 4 PP ranks holds the routes its 12 MoE layers recorded for a
micro-batch of 16 sequences (lengths around 4096).

* verl: ``verl.utils.megatron.router_replay_utils.pp_gather`` on verl's own layouts: a nested
  jagged int16 tensor ``[bs, seq_i, local_layers, K]`` (pickled through ``all_gather_object``) and
  the dense padded ``[bs, max_len, local_layers, K]`` int16 tensor (padded all_gather);
* r3bridge: ``r3bridge.megatron.recorder.gather_recorded``: compact uint8 tensor all-gather, then
  ``unshard`` into a per-sample ReplayBatch (the complete R2 result, sequences in sample order).

Reported: median wall time per gather on rank 0 (barrier to barrier) and ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch


def rank_fn(ctx, args):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_utils import pp_gather

    # verl picks its device once at import; under the harness's CPU shim it says "cuda"
    router_replay_utils.device_name = "cpu"

    from r3bridge.layout import ParallelLayout
    from r3bridge.megatron.recorder import gather_recorded
    from r3bridge.megatron.step import MicroBatch

    g = torch.Generator().manual_seed(0)
    lens = (torch.full((args.seqs,), args.mean_len) + torch.randint(-512, 513, (args.seqs,), generator=g)).tolist()
    layout = ParallelLayout(num_layers=args.layers, pp=4)
    local = layout.moe_layers(ctx.pp_rank)
    k, total, max_len = args.topk, sum(lens), max(lens)
    routes = torch.rand((total, len(local), args.experts), generator=g).topk(k, -1).indices  # [T, l, K]
    per_seq = list(routes.split(lens))
    nested = torch.nested.as_nested_tensor([r.to(torch.int16) for r in per_seq], layout=torch.jagged)
    dense = torch.zeros((args.seqs, max_len, len(local), k), dtype=torch.int16)
    for i, r in enumerate(per_seq):
        dense[i, : r.shape[0]] = r.to(torch.int16)
    tf = SimpleNamespace(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=None)
    rep = SimpleNamespace(layout=layout, topk=k, num_experts=args.experts, device=torch.device("cpu"),
                          chunks=[SimpleNamespace(layer_ids=local)], pp_rank=ctx.pp_rank,
                          groups={"pp": ps.get_pipeline_model_parallel_group(), "tp": None, "cp": None})
    compact = routes.to(torch.uint8)

    def r3bridge_gather():
        mb = MicroBatch(0, 0, total, total, lens, dict(format="thd", cu_seqlens_padded=None, seq_length=None),
                        list(range(args.seqs)),
                        recorded={lid: compact[:, j].contiguous() for j, lid in enumerate(local)})
        return gather_recorded(rep, [mb])

    payload = compact.permute(1, 0, 2).contiguous().reshape(-1)

    def floor_all_gather():   # the transport alone: r3bridge's payload, one all_gather, no unpacking
        parts = [torch.empty_like(payload) for _ in range(4)]
        dist.all_gather(parts, payload, group=rep.groups["pp"])
        return parts

    variants = {"floor_all_gather_uint8": floor_all_gather,
                "verl_pp_gather_nested": lambda: pp_gather(nested, tf),
                "verl_pp_gather_dense": lambda: pp_gather(dense, tf),
                "r3bridge_gather_recorded": r3bridge_gather}
    times = {name: [] for name in variants}
    for _ in range(args.repeats + 1):
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            res = fn()
            dist.barrier()
            if name == "r3bridge_gather_recorded":
                out = res
            times[name].append(time.perf_counter() - t0)
    # the r3bridge result is the full per-sample batch: check it against the inputs on rank 0
    rb = out
    ok = rb.num_seqs == args.seqs and rb.rows_per_seq == lens and rb.layer_ids == tuple(layout.moe_layer_ids)
    return {name: statistics.median(v[1:]) for name, v in times.items()} | {"result_ok": ok}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--mean-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from r3bridge.testing.dist import spawn

    res = spawn(rank_fn, world_size=4, pp=4, args=(args,), timeout=1200)[0]
    r3 = res["r3bridge_gather_recorded"]
    out = {"median_s": {k: v for k, v in res.items() if k != "result_ok"}, "result_ok": res["result_ok"],
           "speedup_vs_verl_nested": res["verl_pp_gather_nested"] / r3,
           "speedup_vs_verl_dense": res["verl_pp_gather_dense"] / r3, "shape": vars(args),
           "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}, CPU gloo"}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
