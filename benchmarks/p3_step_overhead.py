"""P3: step overhead of R3 replay, by device time and wall time, side by side with native routing.

    python benchmarks/p3_step_overhead.py [--spec local|te] [--route-sets 4] [--layers 8 --hidden 2048
                                           --experts 64 --topk 8 --seqs 4 --seq-len 2048 --iters 12]
                                           [--arms native,r3,...] [--profile] [--json]
    python benchmarks/p3_step_overhead.py --device cpu --layers 2 --hidden 64 --experts 8 --topk 2 \\
                                          --seqs 2 --seq-len 64 --iters 3     # the script's own check, no GPU

Model: megatron-core GPTModel, every layer MoE, alltoall dispatcher, bf16 (fp32 on the CPU), on either
layer spec:

* ``--spec te``: Transformer Engine's (TE attention on packed THD input, TEGroupedMLP), what
  production jobs build; one packed micro-batch of ``seqs x seq_len`` tokens;
* ``--spec local``: megatron-core's torch modules (SequentialMLP); local attention refuses THD, so
  the same tokens go in as BSHD (b = seqs) with a causal mask.

``--route-sets N`` token batches are drawn and each one's routes recorded once (R2 record, last
token of each sequence dropped as the engines do). Step ``i`` of every arm runs batch ``i % N``,
so native routing and replay see the same tokens and the same expert loads. Arms:

* native: no replay object attached (the replayer detached, as a job without r3bridge);
* native+hooks: the replayer attached but no pass open: every router call goes through r3bridge's
  hook, which routes natively (what changes on the host when a router carries a replay object);
* r3: R3 replay of batch ``i % N``'s recorded routes, targets installed per step (the host read and
  the host-to-device copy inside the step), agreement metric off;
* r3+agreement: the same with the per-layer native-vs-replayed agreement computed in the hook;
* r3+trace: r3+agreement through :class:`r3bridge.session.PhaseRunner` with ``trace_dir`` set (its
  cost is read against r3+agreement, which computes the same native top-k);
* r3_one_set: batch 0's routes replayed on batch 0 every step: with one route set the expert GEMMs
  see the same load every step, a cache effect that made "R3" look faster than native before
  2026-11-25 (field notes 12 and 14); shown as that artifact, not as replay's cost.

Steps are interleaved: every round runs each arm once, in an order drawn per round (``--order
shuffle``, seeded) or rotated by one (``rotate``: A B C, B C A, ...: each arm always follows the
same arm within a round), after ``--warmup`` rounds. Per step, each arm reports:

* ``wall``: host clock from a synchronized start to a synchronized end;
* ``enqueue``: host clock until the step's last op was queued (before the final synchronize):
  when ``enqueue`` is close to ``wall`` the step is bound by the host, not the device;
* ``span``: CUDA events at the step's start and end: the device timeline of the step (idle gaps
  included where the host was late);
* ``router``: CUDA events in a forward pre-hook (first to run) and a forward hook of every
  router: the router's forward with r3bridge's hook and its padding mask (the router-to-dispatch
  region), summed over the step's router calls;
* ``install``: CUDA events (and the host clock) around the replay arms' install (route read,
  host-to-device copy, widening);
* ``gc``: time in Python's garbage collector, ``mallocs``: the CUDA caching allocator's device
  allocations (cudaMalloc) during the step, ``faults``: the process's minor page faults (host
  memory handed back to the OS and taken again).

Then one untimed step per arm under ``torch.cuda.set_sync_debug_mode('warn')`` counts the host
syncs by source line, and ``--profile`` adds one profiled step per arm: the device's busy time
(every kernel and copy counted once), the kernels launched, the CUDA runtime's synchronizing
calls. On the CPU (``--device cpu``, gloo, one rank) the events are host clocks and the profile
counts aten ops: a check of the script, and of what the hook adds per router call, not a P3 figure.
Also reported: the replay memory held per in-flight micro-batch against the budget
``local layers x local rows x K x 8`` bytes.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import random
import resource
import statistics
import sys
import time
import warnings

import torch
from _common import machine_info

ARMS = ("native", "native+hooks", "r3", "r3+agreement", "r3+trace", "r3_one_set")


def build(args, ctx):
    """The model on ``args.device`` (CUDA: bf16, one NCCL rank set up here; CPU: the harness's
    fp32 model inside the harness's one gloo rank ``ctx``)."""
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 without Transformer Engine: the router references te_general_gemm,
    # a name only defined when TE imports (docs/testing-harness.md).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if args.device == "cpu":
        from r3bridge.testing.harness.models import ModelSpec, build_model_chunks

        spec = ModelSpec(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                         moe_ffn_hidden_size=args.expert_ffn, num_attention_heads=args.heads,
                         vocab_size=args.vocab, max_sequence_length=args.seq_len, num_moe_experts=args.experts,
                         moe_router_topk=args.topk, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-3,
                         position_embedding_type="rope")
        return build_model_chunks(spec, ctx)[0]
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    te = args.spec == "te"
    if te:
        from r3bridge.testing.harness.models import require_te
        require_te()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, moe_grouped_gemm=te,
        moe_permute_fusion=False, moe_router_fusion=False, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        variable_seq_lengths=True)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=te)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq_len, position_embedding_type="rope")
    # local-spec norms are torch LayerNorms created in fp32; Float16Module would cast them
    return model.to(device="cuda", dtype=torch.bfloat16)


class Inputs:
    """One token batch in the layout the spec takes: packed THD (TE) or BSHD + causal mask (local)."""

    def __init__(self, args, seed: int) -> None:
        b, s = args.seqs, args.seq_len
        dev = args.device
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = [s] * b
        self.te = args.spec == "te"
        tokens = torch.randint(0, args.vocab, (b, s), generator=g).to(dev)
        if self.te:
            from megatron.core.packed_seq_params import PackedSeqParams

            self.cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
            self.tokens = tokens.reshape(1, b * s)
            self.pos = torch.arange(s, device=dev).repeat(b).unsqueeze(0)
            self.mask = None
            self.psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu,
                                       cu_seqlens_q_padded=self.cu, cu_seqlens_kv_padded=self.cu,
                                       max_seqlen_q=s, max_seqlen_kv=s)
        else:
            self.tokens = tokens
            self.pos = torch.arange(s).expand(b, s).to(dev)
            self.mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s).to(dev)
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


class Mark:
    """A point on the device timeline: a CUDA event (timed, no sync), or the host clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.host = 0.0

    def record(self) -> "Mark":
        if self.event is not None:
            self.event.record()
        else:
            self.host = time.perf_counter()
        return self

    def ms_to(self, end: "Mark") -> float:
        if self.event is not None:
            return self.event.elapsed_time(end.event)
        return (end.host - self.host) * 1e3


class StepClock:
    """Times one step of an arm: wall, enqueue, device span, the router region of every router
    call (hooks registered once on each router, the pre-hook before any other), install, gc and
    cudaMalloc counts. The router hooks record only while a step is being timed."""

    def __init__(self, routers, cuda: bool) -> None:
        self.cuda = cuda
        self._router: list[tuple[Mark, Mark]] = []
        self._open: dict[int, Mark] = {}
        self._install: list[tuple[Mark, Mark, float]] = []
        self.on = False
        self._gc_t0 = 0.0
        self.gc_s = 0.0
        gc.callbacks.append(self._gc)
        for router in routers:
            router.register_forward_pre_hook(self._pre, prepend=True)
            router.register_forward_hook(self._post)

    def _gc(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    def _pre(self, module, args):
        if self.on:
            self._open[id(module)] = Mark(self.cuda).record()

    def _post(self, module, args, output):
        start = self._open.pop(id(module), None)
        if start is not None:
            self._router.append((start, Mark(self.cuda).record()))

    def install(self, fn):
        """Run an install, timed (host clock and device marks) while a step is timed."""
        if not self.on:
            return fn()
        a, t0 = Mark(self.cuda).record(), time.perf_counter()
        out = fn()
        self._install.append((a, Mark(self.cuda).record(), time.perf_counter() - t0))
        return out

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self, fn) -> dict:
        self._router.clear()
        self._install.clear()
        self.gc_s = 0.0
        mallocs0 = _mallocs() if self.cuda else 0
        self._sync()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.on = True
        t0 = time.perf_counter()
        start = Mark(self.cuda).record()
        fn()
        end = Mark(self.cuda).record()
        t_enq = time.perf_counter()
        self._sync()
        t1 = time.perf_counter()
        self.on = False
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        return {"wall": (t1 - t0) * 1e3, "enqueue": (t_enq - t0) * 1e3, "span": start.ms_to(end),
                "router": sum(a.ms_to(b) for a, b in self._router), "router_calls": len(self._router),
                "install": sum(a.ms_to(b) for a, b, _ in self._install),
                "install_host": sum(h for _, _, h in self._install) * 1e3,
                "gc": self.gc_s * 1e3, "mallocs": (_mallocs() - mallocs0) if self.cuda else 0, "faults": faults}


def _mallocs() -> int:
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


def count_syncs(fn) -> dict:
    """One step under ``set_sync_debug_mode('warn')``: the synchronizing CUDA calls it makes, by
    source line (the Python line that made the call)."""
    where: collections.Counter = collections.Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{_short(w.filename)}:{w.lineno}"] += 1
    torch.cuda.synchronize()
    return {"syncs": sum(where.values()), "by_line": dict(where.most_common(8))}


def _short(path: str) -> str:
    for root in ("r3bridge", "megatron", "torch", "transformer_engine", "benchmarks"):
        i = path.rfind(f"/{root}/")
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)


def profile_step(fn, cuda: bool) -> dict:
    """One profiled step: the device's busy time (every op's self device time: kernels and copies
    counted once), kernels launched, synchronizing runtime calls; on the CPU the aten ops run."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    busy, runtime, aten_ops, by_op = 0.0, collections.Counter(), 0, collections.Counter()
    top = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        busy += float(t or 0.0)
        if e.key.startswith("cuda") and ("Synchronize" in e.key or "Memcpy" in e.key or e.key == "cudaLaunchKernel"):
            runtime[e.key] += e.count
        if e.key.startswith("aten::"):
            aten_ops += e.count
            by_op[e.key] += e.count
        if t:
            top.append((e.key[:80], round(float(t) / 1e3, 3)))
    kernels = sum(1 for ev in prof.events() if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA)
    out = {"device_busy_ms": round(busy / 1e3, 3), "aten_ops": aten_ops, "aten_by_op": dict(by_op),
           "runtime_calls": dict(runtime),
           "top_device_ms": sorted(top, key=lambda r: -r[1])[:8]}
    if cuda:
        out["device_ops"] = kernels
    return out


def _bench(ctx, args) -> dict:
    import shutil
    import tempfile

    import r3bridge
    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import Replayer
    from r3bridge.parallel.handed import HandedRoutes
    from r3bridge.session import PhaseRunner

    cuda = args.device == "cuda"
    model = build(args, ctx)
    b = args.seqs
    sets = [Inputs(args, seed) for seed in range(args.route_sets)]
    routes, engine_arrays = [], []
    rec_rep = Replayer([model], agreement=False)
    layers = rec_rep.layer_ids
    routers = list(rec_rep.chunks[0].routers.values())
    for inp in sets:
        with torch.no_grad(), rec_rep.open_pass("record", forward_only=True) as rs:
            inp.install(rs, model, None)
            inp.forward(model, labels=False)
        recorded = rs.recorded
        routes.append(r3bridge.ReplayBatch.from_ragged([recorded.sequence(i)[0][:-1] for i in range(b)],
                                                       num_experts=args.experts, layer_ids=layers, engine="vllm"))
        engine_arrays.append([recorded.sequence(i)[0][:-1].numpy() for i in range(b)])
    rec_rep.detach()
    clock = StepClock(routers, cuda)

    def fwd_bwd(inp):
        out = inp.forward(model)
        out.float().mean().backward()

    state = {"rep": None}

    def replayer():
        if state["rep"] is None:
            state["rep"] = Replayer([model], agreement=False)
        return state["rep"]

    def native(k):
        fwd_bwd(sets[k])

    def handed(k):
        """Route set ``k`` as the arm hands it over: ``--routes engine`` vLLM's per-sequence arrays
        (what the adapters hand: read and checked on the device per micro-batch), ``batch`` a
        validated ReplayBatch (not checked again)."""
        if args.routes == "batch":
            return routes[k]
        return HandedRoutes.from_engine(engine_arrays[k], num_experts=args.experts, moe_layer_ids=layers,
                                        layer_axis="moe_only", engine="vllm")

    def replay(k, agreement, routes_of=None):
        rep = replayer()
        rep.agreement = agreement
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            clock.install(lambda: sets[k].install(st, model, handed(k if routes_of is None else routes_of)))
            fwd_bwd(sets[k])

    trace_dir = tempfile.mkdtemp(prefix="r3b_p3_trace_")
    traced = PhaseRunner(None, ReplayConfig(replay_mode="R3", trace_dir=trace_dir), framework="p3")
    written = []

    def replay_traced(k):
        rep = replayer()
        rep.agreement = True
        traced.replayer = rep                  # the arm's runner follows the (re-attached) replayer
        with traced.run(Phase.UPDATE, forward_only=False) as ps:
            clock.install(lambda: ps.install(model, sets[k].micro_batch(handed(k))))
            fwd_bwd(sets[k])
        written.append(ps.result.metrics.get("r3bridge/trace/bytes", 0.0))

    variants = {
        "native": native,
        "native+hooks": native,
        "r3": lambda k: replay(k, False),
        "r3+agreement": lambda k: replay(k, True),
        "r3+trace": replay_traced,
        "r3_one_set": lambda k: replay(0, False, routes_of=0),
    }
    names = [a for a in args.arms.split(",") if a]
    unknown = [a for a in names if a not in variants]
    if unknown or "native" not in names:
        raise SystemExit(f"--arms: unknown {unknown} (known: {', '.join(ARMS)}); 'native' is required")

    def prepare(name):
        """Outside the clock: the arm's replay object attached (or, for native, detached)."""
        if name == "native" and state["rep"] is not None:
            state["rep"].detach()
            state["rep"] = None
        elif name != "native":
            replayer()
        model.zero_grad(set_to_none=True)

    steps = []
    prev = None
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    for it in range(args.warmup + args.iters):
        # every round runs each arm once; "rotate" shifts the order by one per round (each arm
        # keeps its predecessor), "shuffle" draws it (seeded), so that what an arm pays for the arm
        # before it (leftover garbage, allocator state, a re-attached replayer) shows by predecessor
        if args.order == "rotate":
            order = names[it % len(names):] + names[:it % len(names)]
        else:
            order = rng.sample(names, len(names))
        for pos, name in enumerate(order):
            prepare(name)
            k = 0 if name == "r3_one_set" else it % args.route_sets
            rec = clock.step(functools.partial(variants[name], k))
            if it >= args.warmup:
                steps.append({"arm": name, "round": it, "pos": pos, "prev": prev, **rec})
            prev = name
        print(f"p3: round {it + 1}/{args.warmup + args.iters} ({'warm-up' if it < args.warmup else 'timed'}) "
              f"{time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)
    arms = {}
    for name in names:
        mine = [s for s in steps if s["arm"] == name]
        arms[name] = {key: {"median": statistics.median(s[key] for s in mine), "min": min(s[key] for s in mine)}
                      for key in ("wall", "enqueue", "span", "router", "install", "install_host", "gc", "mallocs", "faults")}
        arms[name]["router_calls"] = mine[0]["router_calls"]
        # position effects: the arm's median wall time when it ran first in its round vs later
        first = [s["wall"] for s in mine if s["pos"] == 0]
        later = [s["wall"] for s in mine if s["pos"] > 0]
        arms[name]["wall_first_in_round"] = statistics.median(first) if first else None
        arms[name]["wall_later_in_round"] = statistics.median(later) if later else None
        # the arm's median wall time by the arm that ran before it
        arms[name]["wall_after"] = {p: statistics.median(s["wall"] for s in mine if s["prev"] == p)
                                    for p in names if any(s["prev"] == p for s in mine)}
    syncs, profiles = {}, {}
    for name in names:
        prepare(name)
        k = 0 if name == "r3_one_set" else 1 % args.route_sets
        if cuda:
            syncs[name] = count_syncs(functools.partial(variants[name], k))
        if args.profile:
            prepare(name)
            profiles[name] = profile_step(functools.partial(variants[name], k), cuda)
    seq_lens = sets[0].seq_lens
    layout = replayer().layout
    if args.spec == "te":
        t = r3bridge.shard(routes[0], layout, seq_lens, format="thd", cu_seqlens_padded=sets[0].cu.cpu(),
                           device=args.device)
    else:
        t = r3bridge.shard(routes[0], layout, seq_lens, format="bshd", seq_length=args.seq_len, device=args.device)
    budget = len(layers) * t.num_rows * args.topk * 8
    held = sum(x.numel() * x.element_size() for x in t.indices.values())
    shutil.rmtree(trace_dir, ignore_errors=True)
    res = {
        "benchmark": "P3 step overhead", "machine": machine_info(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "transformer_engine": _te_version(),
        "shape": vars(args), "arms": arms, "syncs": syncs, "steps": steps,
        "overhead": _overheads(arms),
        "trace_bytes_per_pass": written[-1] / len(written) if written else 0.0,
        "replay_bytes_per_microbatch": held, "valid_mask_bytes": t.valid.numel(), "budget_bytes": budget,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    if profiles:
        res["profile"] = profiles
    return res


def _overheads(arms: dict) -> dict:
    """Each arm against native: wall and device span (medians and minima), and what the router
    region and the install add per step, as a fraction of native's device span."""
    nat = arms["native"]
    out = {}
    for name, a in arms.items():
        if name == "native":
            continue
        out[name] = {
            "wall_median": a["wall"]["median"] / nat["wall"]["median"] - 1,
            "wall_min": a["wall"]["min"] / nat["wall"]["min"] - 1,
            "span_median": a["span"]["median"] / nat["span"]["median"] - 1,
            "span_min": a["span"]["min"] / nat["span"]["min"] - 1,
            "router_ms_per_step": a["router"]["median"] - nat["router"]["median"],
            "install_ms_per_step": a["install"]["median"],
            # replay's device work in the step: its router region beyond native's plus its install
            "router_and_install_of_span": (a["router"]["median"] - nat["router"]["median"] + a["install"]["median"])
                                          / nat["span"]["median"],
        }
    return out


def print_table(res: dict) -> None:
    m, sh = res["machine"], res["shape"]
    print(f"P3 | {res['device']} | commit {m.get('commit')} | torch {m['torch']} | TE {res['transformer_engine']} | "
          f"spec {sh['spec']} | {sh['layers']} layers, hidden {sh['hidden']}, {sh['experts']} experts top-{sh['topk']}, "
          f"{sh['seqs']} x {sh['seq_len']} tokens, {sh['route_sets']} route sets, routes as {sh['routes']} | "
          f"{sh['iters']} rounds after "
          f"{sh['warmup']} warm-up, arm order: {sh['order']}")
    cols = ("wall", "enqueue", "span", "router", "install", "install_host", "gc", "mallocs", "faults")
    head = {"wall": "wall ms", "enqueue": "enqueue ms", "span": "dev span ms", "router": "router ms",
            "install": "install dev", "install_host": "install host", "gc": "gc ms", "mallocs": "cudaMalloc",
            "faults": "page faults"}
    print(f"{'arm (median / min)':<16}" + "".join(f"{head[c]:>17}" for c in cols) + f"{'syncs':>7}")
    for name, a in res["arms"].items():
        cells = "".join(f"{a[c]['median']:>9.2f} /{a[c]['min']:>6.2f}" for c in cols)
        s = res["syncs"].get(name, {}).get("syncs", "-")
        print(f"{name:<16}{cells}{s:>7}")
    print("against native (medians; min in brackets):")
    for name, o in res["overhead"].items():
        print(f"  {name:<14} wall {o['wall_median']:+7.2%} ({o['wall_min']:+7.2%})  device span {o['span_median']:+7.2%} "
              f"({o['span_min']:+7.2%})  router {o['router_ms_per_step']:+.3f} ms + install {o['install_ms_per_step']:.3f} ms"
              f" per step = {o['router_and_install_of_span']:+.2%} of native's device span")
    for name, a in res["arms"].items():
        if a["wall_first_in_round"] is not None and a["wall_later_in_round"] is not None:
            print(f"  {name:<14} wall median first in its round {a['wall_first_in_round']:.2f} ms, "
                  f"later {a['wall_later_in_round']:.2f} ms")
    print("  wall median by the arm before (rows: arm, columns: the arm before it):")
    names = list(res["arms"])
    print(f"    {'':<14}" + "".join(f"{p[:12]:>13}" for p in names))
    for name, a in res["arms"].items():
        print(f"    {name:<14}" + "".join(f"{a['wall_after'][p]:>13.2f}" if p in a["wall_after"] else f"{'-':>13}"
                                       for p in names))
    for name, s in res["syncs"].items():
        print(f"  syncs {name:<14} {s['syncs']}: {s['by_line']}")
    prof = res.get("profile", {})
    for name, p in prof.items():
        print(f"  profile {name:<12} busy {p['device_busy_ms']} ms, device ops {p.get('device_ops', '-')}, aten ops "
              f"{p['aten_ops']}, runtime {p['runtime_calls']}")
        if name != "native" and "native" in prof:
            base = prof["native"]["aten_by_op"]
            delta = {op: n - base.get(op, 0) for op, n in p["aten_by_op"].items() if n != base.get(op, 0)}
            delta.update({op: -n for op, n in base.items() if op not in p["aten_by_op"]})
            top = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:14]
            print(f"    aten ops vs native: {', '.join(f'{op[6:]} {n:+d}' for op, n in top) or 'the same'}")
    print(f"replay memory per micro-batch {res['replay_bytes_per_microbatch']} bytes (budget {res['budget_bytes']}), "
          f"peak GPU {res['peak_gpu_bytes']}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--spec", choices=["local", "te"], default=None, help="default: te on cuda, local on cpu")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, 'native' required (known: {', '.join(ARMS)})")
    p.add_argument("--route-sets", type=int, default=4, help="token batches / recorded route sets cycled through")
    p.add_argument("--routes", choices=["engine", "batch"], default="engine",
                   help="how the replay arms hand routes over: vLLM's arrays (as adapters do: checked on the device "
                        "per micro-batch) or a validated ReplayBatch (not checked again)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--expert-ffn", type=int, default=1024)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--order", choices=["shuffle", "rotate"], default="shuffle",
                   help="arm order per round: drawn (seeded), or rotated by one (each arm keeps its predecessor)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args()
    if args.spec is None:
        args.spec = "te" if args.device == "cuda" else "local"
    if args.device == "cpu":
        if args.spec == "te":
            raise SystemExit("--spec te needs --device cuda")
        from r3bridge.testing.harness.dist import run_as_only_rank

        res = run_as_only_rank(_bench, args=(args,))
    else:
        res = _bench(None, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res)


def _te_version():
    try:
        import transformer_engine
    except ImportError:
        return None
    return str(transformer_engine.__version__)


if __name__ == "__main__":
    sys.exit(main())
