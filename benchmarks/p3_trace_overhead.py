"""P3-style cost of route tracing (the ``trace_dir`` option), on the CPU harness.

    python benchmarks/p3_trace_overhead.py [--layers 4 --hidden 256 --experts 16 --topk 4
                                            --seqs 4 --seq-len 512 --iters 20] [--json]

Model: the harness's megatron-core GPTModel (local spec, identity attention so THD packing runs on
CPU, every layer MoE), fp32, one rank (gloo). One micro-batch of ``seqs x seq_len`` tokens, packed
(THD). Per iteration one update pass (forward + backward) through :class:`PhaseRunner`, variants
interleaved per iteration so load changes on the machine hit all alike:

* ``r3``: R3 replay of the model's own routes (recorded once, last token dropped as engines do),
  the agreement metric on (the default);
* ``r3+trace``: the same with ``trace_dir`` set: the native top-k and the target kept on the
  device per router call, then each pass written (two CRC-checked payloads and one index line);
* ``r3+trace,agreement off``: tracing forces the native top-k that the agreement metric would
  compute anyway; this variant shows the cost when the metric is off.

Reported: median and minimum seconds per pass and their ratios to ``r3``, the median time of the
end-of-pass write alone (payloads, index line, the budget all-reduce), bytes written per pass. The GPU cost is
measured side by side in P3 (``benchmarks/p3_step_overhead.py``, arm ``r3+trace`` against
``r3+agreement``: docs/benchmarks.md, "P3t").
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time


def _run(ctx, args) -> dict:
    import torch

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import MicroBatch, Replayer
    from r3bridge.session import PhaseRunner
    from r3bridge.testing.harness.data import make_packed_batch
    from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    spec = ModelSpec(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden,
                     num_attention_heads=4, vocab_size=1024, num_moe_experts=args.experts,
                     moe_router_topk=args.topk, moe_aux_loss_coeff=0.0, attention="identity")
    chunks = build_model_chunks(spec, ctx)
    fstep = make_forward_step(ctx, thd=True)
    batch = make_packed_batch([args.seq_len] * args.seqs, 1024, seed=1)
    lens = batch.seq_lens
    rec_cfg = ReplayConfig(replay_mode="R2")
    rep = Replayer.from_config(chunks, rec_cfg)
    with PhaseRunner(rep, rec_cfg).run(Phase.OLD_LOG_PROB, forward_only=True,
                                       targets=[MicroBatch(lens, cu_seqlens_padded=batch.cu_seqlens_padded)]) as ps:
        run_schedule(chunks, [batch], fstep, forward_only=True)
    rec = ps.result.recorded
    rep.detach()
    routes = ReplayBatch.from_ragged([rec.sequence(i)[0][:-1] for i in range(rec.num_seqs)],
                                     num_experts=args.experts, layer_ids=list(rec.layer_ids), engine="vllm")
    mb = MicroBatch(lens, routes, cu_seqlens_padded=batch.cu_seqlens_padded)
    tmp = tempfile.mkdtemp(prefix="r3b_trace_bench_")
    variants = {
        "r3": ReplayConfig(replay_mode="R3"),
        "r3+trace": ReplayConfig(replay_mode="R3", trace_dir=f"{tmp}/a"),
        "r3+trace,agreement off": ReplayConfig(replay_mode="R3", agreement=False, trace_dir=f"{tmp}/b"),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    write_s: dict[str, list[float]] = {}
    written: dict[str, float] = {}
    try:
        for it in range(args.warmup + args.iters):
            for name, cfg in variants.items():
                rep = Replayer.from_config(chunks, cfg)
                runner = PhaseRunner(rep, cfg)
                if runner.tracer is not None:       # time the end-of-pass write on its own (this instance only)
                    runner.tracer.finish = _timed(runner.tracer.finish, write_s.setdefault(name, []), it >= args.warmup)
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                with runner.run(Phase.UPDATE, forward_only=False, targets=[mb]) as ps:
                    run_schedule(chunks, [batch], fstep, forward_only=False)
                dt = time.perf_counter() - t0
                rep.detach()
                if it >= args.warmup:
                    times[name].append(dt)
                written[name] = ps.result.metrics.get("r3bridge/trace/bytes", 0.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    return {"torch": torch.__version__, "shape": vars(args), "median_s": med, "min_s": low,
            "ratio_to_r3_median": {k: med[k] / med["r3"] for k in med},
            "ratio_to_r3_min": {k: low[k] / low["r3"] for k in low},
            "write_s_per_pass_median": {k: statistics.median(v) for k, v in write_s.items() if v},
            "bytes_per_pass": written, "tokens": sum(lens)}


def _timed(fn, sink: list, keep: bool):
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if keep:
                sink.append(time.perf_counter() - t0)
    return call


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from r3bridge.testing.harness.dist import spawn

    (res,) = spawn(_run, world_size=1, args=(args,), timeout=3000)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
