"""Write a route trace of a small R3 training run on the CPU harness (the figure in docs/cli.md).

    python scripts/trace_example.py OUT_DIR [--steps 4] [--lr 0.05]
    r3bridge inspect OUT_DIR --plot docs/img/trace-inspect.png
    r3bridge diff OUT_DIR --plot docs/img/trace-diff.png

A harness megatron-core GPT (4 layers, layer 0 dense, 8 experts top-2, identity attention, THD)
stands for the trainer. The "rollout engine" is the same model one RL step behind: each step's
rollout routes are the routes the model chose (an R2 recording pass, not traced) before the previous
step's updates, so compute_log_prob of step 1 agrees fully and later passes show the router drifting
away from the engine's, layer by layer. Each step: compute_log_prob (4 micro-batches), then two
update mini-batches of 2 micro-batches, each followed by an SGD step; R3 with ``trace_dir`` set.
"""
from __future__ import annotations

import argparse


def _run(ctx, out: str, steps: int, lr: float) -> int:
    import torch

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import MicroBatch, Replayer
    from r3bridge.session import PhaseRunner
    from r3bridge.testing.harness.data import make_packed_batch
    from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    spec = ModelSpec(num_layers=4, moe_layer_freq=[0, 1, 1, 1], hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, vocab_size=256, num_moe_experts=8, moe_router_topk=2,
                     moe_aux_loss_coeff=0.0, attention="identity")
    chunks = build_model_chunks(spec, ctx)
    fstep = make_forward_step(ctx, thd=True)
    lens = [[40, 24], [33, 47], [28, 36], [45, 30]]
    batches = [make_packed_batch(x, 256, seed=7 + i) for i, x in enumerate(lens)]
    ids = [[2 * k, 2 * k + 1] for k in range(len(batches))]
    params = [p for c in chunks for p in c.parameters()]

    def record() -> ReplayBatch:
        cfg = ReplayConfig(replay_mode="R2")
        rep = Replayer.from_config(chunks, cfg)
        mbs = [MicroBatch(b.seq_lens, sample_ids=i, cu_seqlens_padded=b.cu_seqlens_padded) for b, i in zip(batches, ids)]
        with PhaseRunner(rep, cfg).run(Phase.OLD_LOG_PROB, forward_only=True, targets=mbs) as ps:
            run_schedule(chunks, batches, fstep, forward_only=True)
        rep.detach()
        rec = ps.result.recorded
        # as an engine reports them: no route for each sequence's last token
        return ReplayBatch.from_ragged([rec.sequence(i)[0][:-1] for i in range(rec.num_seqs)],
                                       num_experts=rec.num_experts, layer_ids=list(rec.layer_ids), engine="vllm")

    cfg = ReplayConfig(replay_mode="R3", trace_dir=out)
    rollout = record()
    runner = PhaseRunner(None, cfg, framework="harness")   # one runner: the tracer counts the steps
    for _ in range(steps):
        next_rollout = record()                     # the engine's weights for the next step: these
        # (a recording Replayer and the replaying one cannot share the routers: one at a time)
        runner.replayer = Replayer.from_config(chunks, cfg)

        def mb(k: int, rollout: ReplayBatch = rollout) -> MicroBatch:
            return MicroBatch(batches[k].seq_lens, rollout.select(ids[k]), ids[k],
                              cu_seqlens_padded=batches[k].cu_seqlens_padded, uids=[f"prompt{s // 2}-{s % 2}"
                                                                                     for s in ids[k]])
        with runner.run(Phase.OLD_LOG_PROB, forward_only=True, targets=[mb(k) for k in range(4)]):
            run_schedule(chunks, batches, fstep, forward_only=True)
        for part in ([0, 1], [2, 3]):
            for p in params:
                p.grad = None
            with runner.run(Phase.UPDATE, forward_only=False, targets=[mb(k) for k in part]):
                run_schedule(chunks, [batches[k] for k in part], fstep, forward_only=False)
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p -= lr * p.grad
        runner.replayer.detach()
        rollout = next_rollout
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    from r3bridge.testing.harness.dist import spawn

    spawn(_run, world_size=1, args=(args.out, args.steps, args.lr), timeout=1800)
    print(f"wrote {args.out}: r3bridge inspect {args.out}")


if __name__ == "__main__":
    main()
