"""P4: R2 gather of recorded routes over 2 and 4 pipeline stages, r3bridge vs verl 0.9.1's R2 path.

    python benchmarks/p4_r2_gather.py [--device cpu|cuda] [--pp 2,4] [--micro-batches 4] [--seqs 16
                                       --mean-len 4096 --layers 48 --topk 8 --experts 128 --repeats 5] [--json]

``--device cpu`` (default): gloo processes. ``--device cuda``: NCCL processes, one GPU each; the
recorded routes start on the GPU as the routers produced them. ``--pp 2,4`` runs 2 stages, then 4,
in one command (4 needs 4 GPUs), and reports them side by side.

Same inputs on every side: each PP rank holds the routes its MoE layers (48 / pp) recorded for 16
sequences (lengths around 4096) split into ``--micro-batches`` micro-batches the way verl's dynamic
batch size splits them (longest first, to the emptiest micro-batch: samples out of order).

* **verl R2 path**, as verl 0.9.1's ``MegatronEngine`` runs it (``workers/engine/megatron/
  transformer_impl.py``): after each micro-batch's RECORD forward, ``merge_router_topk_indices(...,
  model=chunk)`` on the chunk's own routers (megatron-core ``TopKRouter`` modules carrying verl's
  ``RouterReplay``: stack as int16, SP gather, THD unpack into a nested per-sample tensor,
  ``.cpu()``); after the schedule ``merge_nested_router_maps``, ``pp_gather`` (the nested map
  pickled through ``all_gather_object``) and ``restore_dynamic_batch`` (back to sample order);
* **verl pp_gather only**: that last collective alone, on the nested (or dense padded) CPU map;
* **r3bridge**: the hook's narrowing to uint8 (done at record time in real use, counted here), then
  ``r3bridge.megatron.recorder.gather_recorded``: each stage stacks its layers' compact ids
  token-major, one tensor all-gather per parallel dimension, one pass (``assemble_gathered``) into a
  per-sample ReplayBatch in sample order, one copy to pinned host memory;
* **floor**: one ``all_gather`` of r3bridge's own payload, nothing else.

Both sides end with every layer's per-sample routes on every rank; the script checks they are equal
and that each stage's layers are the routes its routers recorded (``result_ok``).

``--pp 1`` runs on one GPU: no transport (the floor is a one-rank all_gather), so it measures only
each side's work around it.

Reported per pp: median wall time per gather on rank 0 (barrier to barrier) and the ratios
(goals: r3bridge >= 10x faster than verl's R2 path, within 3x the floor).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch


def verl_model_chunk(tf, layer_ids, rru):
    """A model chunk as verl's ``iter_model_routers`` walks it: megatron-core ``TopKRouter`` modules
    under ``chunk.decoder``, each with verl's own ``RouterReplay`` attached and its global layer
    number set (verl 0.9.1's engine passes ``model=unwrapped_model`` to ``merge_router_topk_indices``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    rru.RouterReplay.router_instances.clear()
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "tp_cp", "tp_dp_cp"])
    routers = []
    for lid in layer_ids:
        r = TopKRouter(config=tf, pg_collection=pgs)
        r.router_replay = rru.RouterReplay()
        r.layer_number = lid + 1
        routers.append(r)
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.ModuleList(routers)
    return chunk, routers


def random_routes(rows, layers, experts, k, g):
    """``[rows, layers, k]`` int64 expert ids, distinct within each (row, layer): ``(r + j * s) % E``
    for j < k with a random start r and a random step s coprime to E (cheap: P4 times the transport
    of the ids, not their values; ``rand(...).topk`` would take seconds per stage at this size)."""
    units = torch.tensor([u for u in range(1, experts) if math.gcd(u, experts) == 1])
    start = torch.randint(0, experts, (rows, layers, 1), generator=g)
    step = units[torch.randint(0, units.numel(), (rows, layers, 1), generator=g)]
    return (start + step * torch.arange(k)) % experts


def dynamic_micro_batches(lens, n):
    """verl's dynamic batch size in miniature: samples, longest first, dealt to the micro-batch with
    the fewest tokens; returns each micro-batch's sample indices (what ``restore_dynamic_batch``
    undoes)."""
    tokens = [0] * n
    out = [[] for _ in range(n)]
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        m = tokens.index(min(tokens))
        out[m].append(i)
        tokens[m] += lens[i]
    return [sorted(mb) for mb in out if mb]


def rank_fn(ctx, args):
    import torch.distributed as dist
    from _common import load_verl_router_replay_utils
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    rru = load_verl_router_replay_utils()
    # verl picks its device once at import; under the harness's CPU shim it says "cuda"
    rru.device_name = args.device
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    from r3bridge.batch.schema import route_dtype
    from r3bridge.megatron.installed import InstalledMicroBatch
    from r3bridge.megatron.recorder import gather_recorded
    from r3bridge.parallel.layout import ParallelLayout

    pp, k = ctx.pp, args.topk
    g = torch.Generator().manual_seed(0)           # same lengths on every rank
    lens = (torch.full((args.seqs,), args.mean_len) + torch.randint(-512, 513, (args.seqs,), generator=g)).tolist()
    layout = ParallelLayout(num_layers=args.layers, pp=pp)
    local = layout.moe_layers(ctx.pp_rank)
    max_len = max(lens)
    mbs = dynamic_micro_batches(lens, args.micro_batches)
    g.manual_seed(1 + ctx.pp_rank)                 # each stage's routes differ
    # per sample: [len, local layers, K] int64, what this stage's routers choose for its tokens
    per_seq = list(random_routes(sum(lens), len(local), args.experts, k, g).split(lens))
    # What a router leaves after a RECORD forward of micro-batch m: its own int64 top-k [T_m, K], on
    # its device (verl's RouterReplay.record_indices / r3bridge's hook both get this).
    router_idx = [[torch.cat([per_seq[i][:, j] for i in mb]).to(dev) for j in range(len(local))] for mb in mbs]
    input_ids = [torch.nested.as_nested_tensor([torch.randint(0, 1000, (lens[i],), generator=g) for i in mb],
                                               layout=torch.jagged).to(dev) for mb in mbs]

    # verl's side, as its MegatronEngine runs R2 (transformer_impl.py: forward_backward_batch and
    # forward_step): per micro-batch merge_router_topk_indices(..., model=the chunk) (stack the
    # routers' recorded ids as int16, SP gather, unpack THD into a nested per-sample tensor, .cpu());
    # after the schedule merge_nested_router_maps, pp_gather (all_gather_object of the nested map)
    # and restore_dynamic_batch (micro-batch order -> sample order). The routers are megatron-core
    # TopKRouters carrying verl's own RouterReplay.
    tf = TransformerConfig(num_layers=args.layers, hidden_size=64, num_attention_heads=4, num_moe_experts=args.experts,
                           moe_router_topk=k, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                           use_cpu_initialization=True)
    chunk, routers = verl_model_chunk(tf, local, rru)

    def verl_r2_path():
        per_mb: list = []
        for m in range(len(mbs)):
            for j, r in enumerate(routers):          # the RECORD forward of micro-batch m
                r.router_replay.record_indices(router_idx[m][j])
            rru.merge_router_topk_indices(None, input_ids[m], per_mb, tf, 0, model=chunk)
        return restore_dynamic_batch(rru.pp_gather(rru.merge_nested_router_maps(per_mb), tf), mbs)

    # verl's pp_gather alone, on the CPU tensors merge_router_topk_indices leaves
    nested = torch.nested.as_nested_tensor([r.to(torch.int16) for r in per_seq], layout=torch.jagged)
    dense = torch.zeros((args.seqs, max_len, len(local), k), dtype=torch.int16)
    for i, r in enumerate(per_seq):
        dense[i, : r.shape[0]] = r.to(torch.int16)

    # r3bridge's side: the hook narrows each router's ids as it records (step.py), then
    # gather_recorded does TP/CP/PP all-gathers and one pass into a per-sample ReplayBatch.
    groups = {"pp": ps.get_pipeline_model_parallel_group(), "tp": None, "cp": None}
    narrow = route_dtype(args.experts)

    def r3bridge_path():
        recs = []
        for m, mb in enumerate(mbs):
            t = sum(lens[i] for i in mb)
            recs.append(InstalledMicroBatch(0, m, t, t, [lens[i] for i in mb],
                                            dict(format="thd", cu_seqlens_padded=None, seq_length=None), mb,
                                            recorded={lid: router_idx[m][j].to(narrow) for j, lid in enumerate(local)}))
        return gather_recorded(recs, layout=layout, chunk_layer_ids=[local], pp_rank=ctx.pp_rank, groups=groups,
                               num_experts=args.experts, topk=k, device=dev)

    payload = torch.cat(per_seq).to(narrow).permute(1, 0, 2).contiguous().reshape(-1).view(torch.uint8).to(dev)

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
    # Every rank ends with the whole batch; both sides must hold the same per-sample routes, and
    # this stage's layers must be the routes its routers recorded.
    rb, theirs = results["r3bridge_gather_recorded"], results["verl_r2_path"]
    ours = [rb.sequence(i)[0].to(torch.int64) for i in range(rb.num_seqs)]
    same = all(torch.equal(a, b.to(torch.int64)) for a, b in zip(ours, theirs.unbind()))
    mine = rb.with_layers(local)
    own = all(torch.equal(mine.sequence(i)[0].to(torch.int64), per_seq[i]) for i in range(args.seqs))
    ok = (rb.num_seqs == args.seqs and rb.rows_per_seq == lens and rb.layer_ids == tuple(layout.moe_layer_ids)
          and own and same)
    return {name: statistics.median(v[1:]) for name, v in times.items()} | {
        "result_ok": ok, "payload_bytes_per_rank": payload.numel(), "micro_batches": len(mbs)}


def one_run(args, pp):
    from r3bridge.testing.harness.dist import spawn

    res = spawn(rank_fn, world_size=pp, pp=pp, args=(args,), timeout=1200,
                backend="nccl" if args.device == "cuda" else "gloo")[0]
    r3 = res["r3bridge_gather_recorded"]
    times = {k: v for k, v in res.items() if k not in ("result_ok", "payload_bytes_per_rank", "micro_batches")}
    return {"pp": pp, "median_s": times, "result_ok": res["result_ok"], "micro_batches": res["micro_batches"],
            "payload_bytes_per_rank": res["payload_bytes_per_rank"],
            "speedup_vs_verl_r2_path": res["verl_r2_path"] / r3,
            "speedup_vs_verl_pp_gather_only_nested": res["verl_pp_gather_only_nested"] / r3,
            "speedup_vs_verl_pp_gather_only_dense": res["verl_pp_gather_only_dense"] / r3,
            "r3bridge_over_floor": r3 / res["floor_all_gather"],
            "goals": {"speedup_vs_verl_r2_path>=10": res["verl_r2_path"] / r3 >= 10,
                      "r3bridge_over_floor<=3": r3 / res["floor_all_gather"] <= 3}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--mean-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches of the RECORD pass (verl's dynamic batch size; 1: one micro-batch)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--pp", default="4",
                   help="pipeline stages (one process each); a comma-separated list runs each in turn, side by side")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs = [one_run(args, int(pp)) for pp in str(args.pp).split(",")]
    machine = (f"{torch.cuda.get_device_name(0)}, NCCL, torch {torch.__version__}" if args.device == "cuda" else
               f"gloo, {os.cpu_count()} CPUs, torch {torch.__version__}")
    out = {"runs": runs, "shape": vars(args), "machine": machine}
    if args.json:
        print(json.dumps(out))
        return
    print(machine)
    print(f"{'pp':>3} {'floor ms':>9} {'verl R2 ms':>11} {'pp_gather ms':>13} {'r3bridge ms':>12} "
          f"{'vs verl':>8} {'/ floor':>8} ok")
    for r in runs:
        t = r["median_s"]
        print(f"{r['pp']:>3} {1e3 * t['floor_all_gather']:>9.2f} {1e3 * t['verl_r2_path']:>11.2f} "
              f"{1e3 * t['verl_pp_gather_only_nested']:>13.2f} {1e3 * t['r3bridge_gather_recorded']:>12.2f} "
              f"{r['speedup_vs_verl_r2_path']:>7.1f}x {r['r3bridge_over_floor']:>7.1f}x {r['result_ok']}")


if __name__ == "__main__":
    main()
