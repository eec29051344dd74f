"""P5: the route path at production shape, engine output -> what one rank consumes, side by side.

The same engine output (per-trajectory route arrays as vLLM returns them: numpy
``[tokens - 1, num_hidden_layers, K]``, dense layers as zero rows, **writable**, as vLLM hands
them; built as SkyRL 0.4's ``bench_packed_route_collation.py`` builds its input: views of one
template, so allocating the source does not dominate) goes through each arm in its own process
(peak RSS is the arm's own; "added" = peak minus the RSS after the arm's input was built):

* ``skyrl``: SkyRL 0.4.0's packed collation, ``skyrl/train/dataset/preprocess.py:
  _collate_rollout_expert_indices`` from the wheel (serial fill of one ``[sum(len), L, K]``
  buffer), on writable arrays as SkyRL runs it (on read-only ones it copies every trajectory
  first, ``preprocess.py:115-117``). It packs what it is given: all ``num_hidden_layers`` layers.
* ``verl``: verl 0.9.1's own path (the agent loop's padded int16 per sample, their concatenation,
  ``left_right_2_no_padding``, then per micro-batch ``preprocess_thd_engine`` + SP slice + int64
  per stage layer where megatron-core imports). Skipped, with the size it would need, where its
  padded buffers cannot fit the host.
* r3bridge through each adapter's real per-micro-batch path: the adapter's codec
  (``handed_routes``: the framework's buffer viewed) then the driver's install (``RankRows``
  once per micro-batch, ``read_targets`` of the rank's stage layers, on ``--device``), for every
  micro-batch; the framework's own transport is built first (its work, not timed, not counted in
  the added RSS):

  * ``r3bridge_skyrl``: SkyRL 0.4's ``PackedTensor`` + ``router_padding_mask`` as its collation
    builds them (the generator output collated by SkyRL's own function), one worker micro-batch
    a slice of it;
  * ``r3bridge_verl``: verl's nested jagged int16 ``routed_experts`` (one row per token, zero
    rows past what the engine returned), per micro-batch;
  * ``r3bridge_areal``: AReaL's trajectory tensor ``[B, L_moe, K, S]`` (uint8, sentinel where no
    route), per micro-batch by sample id;
  * ``r3bridge_engine``: ``r3bridge.rank_targets`` straight from the engine arrays.
* ``r3bridge_batch``: ``ReplayBatch.from_vllm`` (the whole-batch canonical build) then ``shard``
  per micro-batch: the whole-batch path, where a framework needs the batch.

The rank: tp 0, cp 0 of pp stage ``--pp-rank`` of TP4 x CP2 x PP4 (SP on). Micro-batches:
consecutive trajectories up to ``--mb-tokens`` tokens; a rank holds one micro-batch's int64
targets at a time. The floor: one copy of the packed bytes (every trajectory's rows, every
reported layer, read once and written once) at the copy bandwidth measured on the same machine
(a multi-threaded ``copy_`` of 2 GiB).

Not a test: prints a table, or one JSON object with ``--json``; ``--plot PNG`` draws time and
added RSS against tokens, log-log (needs matplotlib; never needed for ``--json``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SPREAD = {"uniform": 1.0, "mild_ragged": 0.5, "typical_rl": 1 / 16, "heavy_tail": 1 / 64}   # SkyRL 0.4's
ARMS = ("skyrl", "verl", "r3bridge_skyrl", "r3bridge_verl", "r3bridge_areal", "r3bridge_engine", "r3bridge_batch")
ADAPTER_ARMS = ("r3bridge_skyrl", "r3bridge_verl", "r3bridge_areal", "r3bridge_engine")


# ------------------------------------------------------------------------------ workload
def lengths_of(dist: str, n: int, max_len: int, seed: int) -> np.ndarray:
    """Tokens per trajectory as SkyRL 0.4's benchmark draws them (uniform in [max*spread, max],
    trajectory 0 at max)."""
    rng = np.random.default_rng(seed)
    lo = max(2, int(max_len * SPREAD[dist]))
    lens = rng.integers(lo, max_len + 1, size=n).astype(np.int64)
    lens[0] = max_len
    return lens


def engine_output(lens: np.ndarray, w: dict) -> list[np.ndarray]:
    """vLLM's ``routed_experts`` per trajectory: ``[len - 1, num_layers, K]`` views of one
    template; distinct top-k per row (a random offset plus a stride coprime with E), dense layers 0."""
    rng = np.random.default_rng(w["seed"] + 1)
    rows, nl, k, e = int(lens.max()) - 1, w["layers"], w["topk"], w["experts"]
    off = rng.integers(0, e, size=(rows, nl, 1))
    strides = np.array([s for s in range(1, e) if np.gcd(s, e) == 1])
    step = strides[rng.integers(0, len(strides), size=(rows, nl, 1))]
    tmpl = ((off + step * np.arange(k)) % e).astype(w["dtype"])
    tmpl[:, :w["dense"]] = 0
    return [tmpl[:int(n) - 1] for n in lens]      # writable, as vLLM hands them


def micro_batches(lens: np.ndarray, budget: int) -> list[tuple[int, int]]:
    out, a, tok = [], 0, 0
    for i, n in enumerate(lens.tolist()):
        if tok and tok + n > budget:
            out.append((a, i))
            a, tok = i, 0
        tok += n
    out.append((a, len(lens)))
    return out


def layout_of(w: dict):
    import r3bridge

    freq = tuple([0] * w["dense"] + [1] * (w["layers"] - w["dense"]))
    return r3bridge.ParallelLayout(w["layers"], freq, tp=w["tp"], cp=w["cp"], pp=w["pp"], ep=w["ep"],
                                   sequence_parallel=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: the high-water mark of this process's own address space (``ru_maxrss`` is not: Linux
    carries the parent's over fork + exec, so a child of a big parent reads the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ------------------------------------------------------------------------------ arms
def arm_skyrl(items, lens, w, mbs, lay, prepared=None):
    sys.path.insert(0, str(HERE))
    from _common import load_skyrl04_preprocess

    pre = load_skyrl04_preprocess(w["skyrl04"])
    t0 = time.perf_counter()
    packed = pre._collate_rollout_expert_indices(items, lens)
    t = time.perf_counter() - t0
    return {"wall_s": t, "out_bytes": packed.values.numel() * packed.values.element_size()
            if hasattr(packed, "values") else None}


def arm_verl(items, lens, w, mbs, lay, prepared=None):
    import torch

    sys.path.insert(0, str(HERE))
    from _common import load_verl_attention_utils

    au = load_verl_attention_utils()
    stage = lay.moe_layers(w["pp_rank"])
    t0 = time.perf_counter()
    total = int(lens.max())
    per_sample = []
    for a in items:     # agent_loop.py: routed_experts = zeros(1, total_length, L, K); [:, start:end] = routes
        arr = a if a.flags.writeable else a.copy()
        ex = torch.from_numpy(arr).to(torch.int16)
        re = torch.zeros(1, total, *ex.shape[1:], dtype=ex.dtype)
        re[:, 0:ex.shape[0]] = ex.unsqueeze(0)
        per_sample.append(re)
    padded = torch.cat(per_sample, dim=0)           # _postprocess: torch.cat([input.routed_experts ...])
    del per_sample
    mask = (torch.arange(total)[None, :] < torch.from_numpy(lens)[:, None]).to(torch.int64)
    # verl's torch implementations (what its dispatchers pick without flash-attn, as on a host
    # CPU; the dispatchers themselves import the whole verl package, ray included)
    _, indices, cu, *_ = au._fallback_unpad_input(torch.zeros(len(lens), total, 1), mask)
    rmpad = au._fallback_index_first_axis(padded.unsqueeze(-1).flatten(0, 1), indices)   # left_right_2_no_padding
    del padded
    nested = torch.nested.nested_tensor_from_jagged(rmpad.squeeze(-1), offsets=cu.to(torch.int64))
    t_batch = time.perf_counter() - t0
    res = {"batch_s": t_batch}
    try:
        import verl.models.mcore.util as vu
        from _common import parallel_state
        from megatron.core.tensor_parallel import mappings
    except Exception as e:          # the GPU image has no megatron-core: batch part only
        res.update(wall_s=t_batch, rank_part="not run: " + type(e).__name__)
        return res
    from unittest import mock

    class _Group:   # TP group stand-in for megatron's SP scatter (only size/rank are read)
        def size(self):
            return w["tp"]

        def rank(self):
            return 0
    offs = nested.offsets()
    values = nested.values()
    t1 = time.perf_counter()
    with parallel_state(tp=w["tp"], cp=w["cp"], cp_rank=0), \
            mock.patch.object(mappings, "get_tensor_model_parallel_group_if_none", lambda g, **k: g):
        for a, b in mbs:        # the engine's micro-batches of the nested batch
            o = offs[a:b + 1]
            mb = torch.nested.nested_tensor_from_jagged(values[int(o[0]):int(o[-1])], offsets=o - o[0])
            packed, _, _ = vu.preprocess_thd_engine(mb, pre_process=True)
            split = mappings.scatter_to_sequence_parallel_region(packed.contiguous().squeeze(0), group=_Group())
            per_layer = split.permute(1, 0, 2)
            targets = {lid: per_layer[lid].to(torch.int64) for lid in stage}
            del targets
    res.update(wall_s=t_batch + time.perf_counter() - t1, rank_s=time.perf_counter() - t1)
    return res


def arm_r3bridge_batch(items, lens, w, mbs, lay, prepared=None):
    import r3bridge

    moe = lay.moe_layer_ids
    t0 = time.perf_counter()
    rb = r3bridge.ReplayBatch.from_vllm(items, num_experts=w["experts"], moe_layer_ids=moe)
    t_build = time.perf_counter() - t0
    t1 = time.perf_counter()
    for a, b in mbs:
        t = r3bridge.shard(rb.select_range(a, b), lay, lens[a:b].tolist(), pp_rank=w["pp_rank"])
        del t
    t_rank = time.perf_counter() - t1
    return {"wall_s": t_build + t_rank, "batch_s": t_build, "rank_s": t_rank,
            "out_bytes": rb.routes.numel() * rb.routes.element_size()}


def _codec(framework: str):
    """``adapters/<framework>/codec.py`` by file (it needs only r3bridge's core): the package
    ``__init__`` imports the framework, which the device image may lack."""
    import importlib.util
    import types

    root = HERE.parent / "adapters"
    for name, path in (("r3bridge.adapters", root), (f"r3bridge.adapters.{framework}", root / framework)):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [str(path)]
            sys.modules[name] = m
    name = f"r3bridge.adapters.{framework}.codec"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, root / framework / "codec.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _drive(handed_of, mbs, lens, w, lay) -> dict:
    """The driver's install for every micro-batch: ``handed_of(a, b)`` -> the adapter's handed
    routes; the row map once, then this rank's stage layers read onto ``w["device"]``."""
    import torch

    from r3bridge.parallel.rank_rows import RankRows
    from r3bridge.parallel.read import read_targets

    dev = torch.device(w["device"])
    want = lay.moe_layers(w["pp_rank"])
    t0 = time.perf_counter()
    rows = 0
    for a, b in mbs:
        handed = handed_of(a, b)
        rr = RankRows.build(lay, lens[a:b].tolist(), tp_rank=0, cp_rank=0).cover(handed)
        t = read_targets(handed, rr, want, device=dev)
        rows += t.num_rows
        del t
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - t0, "rank_rows": rows}


def input_r3bridge_skyrl(items, lens, w):
    """SkyRL 0.4's training batch fields as its own collation builds them."""
    import torch

    sys.path.insert(0, str(HERE))
    from _common import load_skyrl04_preprocess

    pre = load_skyrl04_preprocess(w["skyrl04"])
    packed = pre._collate_rollout_expert_indices(items, lens)
    # every token but the last has a route (vLLM's rows); right-padded [B, S] masks
    s = int(lens.max())
    pos = torch.arange(s)[None, :]
    n = torch.from_numpy(lens)[:, None]
    attn = pos < n
    return {"packed": packed, "attn": attn, "mask": ~(pos < n - 1) | ~attn}


def arm_r3bridge_skyrl(items, lens, w, mbs, lay, prepared):
    codec = _codec("skyrl")
    packed, attn, mask = prepared["packed"], prepared["attn"], prepared["mask"]
    values, cu = packed.values, packed.cu_seqlens.long()
    moe = lay.moe_layer_ids

    class _Part:        # a worker micro-batch's PackedTensor: a slice of the batch's (a view)
        def __init__(self, a, b):
            self.values = values[int(cu[a]):int(cu[b])]
            self.cu_seqlens = cu[a:b + 1] - cu[a]

    def handed_of(a, b):
        fields = {codec.ROUTES_KEY: _Part(a, b), codec.MASK_KEY: mask[a:b], "attention_mask": attn[a:b]}
        return codec.handed_routes(fields, num_experts=w["experts"], moe_layer_ids=moe, num_hidden_layers=w["layers"])
    return _drive(handed_of, mbs, lens, w, lay)


def input_r3bridge_verl(items, lens, w):
    """verl's nested jagged int16 ``routed_experts`` values (one row per token, the last zero)."""
    import torch

    offs = np.zeros(len(lens) + 1, dtype=np.int64)
    offs[1:] = np.cumsum(lens)
    values = torch.zeros((int(offs[-1]), w["layers"], w["topk"]), dtype=torch.int16)
    vn = values.numpy()
    for i, a in enumerate(items):
        vn[offs[i]:offs[i] + a.shape[0]] = a
    return {"values": values, "offsets": torch.from_numpy(offs)}


def arm_r3bridge_verl(items, lens, w, mbs, lay, prepared):
    import torch

    codec = _codec("verl")
    values, offs = prepared["values"], prepared["offsets"]
    # each micro-batch's nested field as verl's micro-batching hands it to the engine (views of the
    # batch's values): verl's work, made before the clock starts like every arm's transport
    nested = {(a, b): torch.nested.nested_tensor_from_jagged(values[int(offs[a]):int(offs[b])],
                                                             offsets=offs[a:b + 1] - offs[a]) for a, b in mbs}

    def handed_of(a, b):
        return codec.handed_routes({codec.ROUTES_KEY: nested[a, b]}, moe_layer_ids=lay.moe_layer_ids,
                                   num_experts=w["experts"], route_kind="rollout", num_hidden_layers=w["layers"],
                                   topk=w["topk"])
    return _drive(handed_of, mbs, lens, w, lay)


def input_r3bridge_areal(items, lens, w):
    """AReaL's batched trajectory tensor ``[B, L_moe, K, S]`` (r3bridge's WorkflowMixin format)."""
    import torch

    from r3bridge.batch.schema import sentinel_dtype

    dtype, none = sentinel_dtype(w["experts"])
    t = torch.full((len(lens), w["layers"] - w["dense"], w["topk"], int(lens.max())), none, dtype=dtype)
    for i, a in enumerate(items):       # the MoE layers are the last ones: a view, no copy
        t[i, :, :, :a.shape[0]] = torch.from_numpy(a[:, w["dense"]:]).permute(1, 2, 0)
    return {"routes": t}


def arm_r3bridge_areal(items, lens, w, mbs, lay, prepared):
    codec = _codec("areal")
    t = prepared["routes"]

    def handed_of(a, b):
        return codec.handed_routes(t, list(range(a, b)), lens[a:b].tolist(), num_experts=w["experts"],
                                   moe_layer_ids=lay.moe_layer_ids, topk=w["topk"])
    return _drive(handed_of, mbs, lens, w, lay)


def arm_r3bridge_engine(items, lens, w, mbs, lay, prepared=None):
    import torch

    from r3bridge import rank_targets

    moe = lay.moe_layer_ids
    dev = torch.device(w["device"])
    t0 = time.perf_counter()
    rows = 0
    for a, b in mbs:
        t = rank_targets(items[a:b], lay, lens[a:b].tolist(), num_experts=w["experts"], moe_layer_ids=moe,
                         pp_rank=w["pp_rank"], device=dev)
        rows += t.num_rows
        del t
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - t0, "rank_rows": rows}


def worker(spec: dict) -> dict:
    import torch

    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    w = spec["workload"]
    w["dtype"] = np.dtype(w["dtype"])
    lens = lengths_of(spec["dist"], spec["n"], spec["max_len"], w["seed"])
    items = engine_output(lens, w)
    lay = layout_of(w)
    mbs = micro_batches(lens, w["mb_tokens"])
    arm = globals()["arm_" + spec["arm"]]
    prepare = globals().get("input_" + spec["arm"], lambda items, lens, w: None)
    # warm-up on a tiny batch: imports and first-call setup (torch's nested tensors, verl's
    # modules, CUDA) are neither the arm's time nor its memory
    tiny = np.array([64, 48], dtype=np.int64)
    tiny_items = engine_output(tiny, w)
    arm(tiny_items, tiny, w, [(0, 2)], lay, prepare(tiny_items, tiny, w))
    prepared = prepare(items, lens, w)      # the framework's own transport: its work, not timed
    base = rss_bytes()
    out = arm(items, lens, w, mbs, lay, prepared)
    out.update(peak_rss=peak_rss_bytes(), base_rss=base, added_rss=peak_rss_bytes() - base,
               threads=torch.get_num_threads())
    return out


# ------------------------------------------------------------------------------ floors
def copy_bandwidth(threads: int) -> float:
    """Bytes read + written per second by a multi-threaded ``copy_`` of 2 GiB (best of 5)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    n = 1 << 31
    src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    dst.copy_(src)
    best = min((lambda t0: (dst.copy_(src), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
    return 2 * n / best


def floor_bytes(arm: str, lens: np.ndarray, w: dict, lay) -> int:
    """The floor of every arm: one copy of the packed bytes (every trajectory's rows, every reported
    layer, read once and written once)."""
    rows = int((lens - 1).sum())
    return 2 * rows * w["layers"] * w["topk"] * np.dtype(w["dtype"]).itemsize


def verl_need(lens, w) -> int:
    return 2 * len(lens) * int(lens.max()) * w["layers"] * w["topk"] * 2


# ------------------------------------------------------------------------------ driver
def run_arm(spec: dict, timeout: int) -> dict:
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if p.returncode:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32x4096,64x8192",
                    help="comma list of TRAJECTORIESxMAX_TOKENS (production: 1024x32768)")
    ap.add_argument("--dists", default="uniform,mild_ragged,typical_rl,heavy_tail")
    ap.add_argument("--arms", default=",".join(a for a in ARMS if a != "verl"),
                    help=f"comma list of {', '.join(ARMS)} (verl's own path needs megatron-core and much memory)")
    ap.add_argument("--dtype", default="uint8", choices=["uint8", "int16"],
                    help="engine route dtype (vLLM: uint8 up to 256 experts; SkyRL's benchmark: int16)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--dense", type=int, default=8, help="first DENSE decoder layers are dense")
    ap.add_argument("--topk", type=int, default=22)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--pp-rank", type=int, default=1)
    ap.add_argument("--mb-tokens", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per arm (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="where the r3bridge arms put (and check) the rank's targets: "
                    "cpu, or cuda on the device host (the router's device)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per arm process")
    ap.add_argument("--skyrl04", default=os.environ.get("R3BRIDGE_SKYRL04", str(HERE.parent / "build" / "skyrl04")))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="PNG path for the log-log plot (matplotlib)")
    ap.add_argument("--from-json", nargs="+", default=None,
                    help="print (and --plot) the results of earlier --json runs instead of running")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return None
    if args.from_json:
        reports = [json.loads(Path(p).read_text()) for p in args.from_json]
        keep = set(args.dists.split(","))
        rows = [r for rep in reports for r in rep["results"] if r["dist"] in keep]
        for rep in reports:
            m = rep["machine"]
            print(f"# {m.get('cpu_model', m['processor'])}, {m['cpu_count']} cpus, host {rep['host_GiB']:.0f} GiB, "
                  f"copy bandwidth {rep['copy_bandwidth_GBps']:.1f} GB/s (read + write), torch {m['torch']}")
        print(markdown(rows), flush=True)
        for key, r in ratios(rows).items():
            print(key, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
        if args.plot:
            plot(rows, args.plot)
        return None
    sys.path.insert(0, str(HERE))
    from _common import machine_info

    w = {"layers": args.layers, "dense": args.dense, "topk": args.topk, "experts": args.experts, "tp": args.tp,
         "cp": args.cp, "pp": args.pp, "ep": args.ep, "pp_rank": args.pp_rank, "mb_tokens": args.mb_tokens,
         "seed": args.seed, "dtype": args.dtype, "skyrl04": args.skyrl04, "device": args.device}
    lay = layout_of(w)
    bw = copy_bandwidth(args.threads)
    rows = []
    for size in args.sizes.split(","):
        n, max_len = (int(x) for x in size.lower().split("x"))
        for dist in args.dists.split(","):
            lens = lengths_of(dist, n, max_len, args.seed)
            for arm in args.arms.split(","):
                spec = {"arm": arm, "dist": dist, "n": n, "max_len": max_len, "threads": args.threads, "workload": w}
                if arm == "verl" and verl_need(lens, w) > 0.8 * host_bytes():
                    res = {"error": f"not run: its padded int16 buffers need {verl_need(lens, w) / 2**30:.0f} GiB, "
                                    f"the host has {host_bytes() / 2**30:.0f} GiB"}
                else:
                    res = run_arm(spec, args.timeout)
                fb = floor_bytes(arm, lens, w, lay)
                res.update(arm=arm, dist=dist, trajectories=n, max_len=max_len, tokens=int(lens.sum()),
                           floor_bytes=fb, floor_s=fb / bw)
                rows.append(res)
                if not args.json:
                    print(_line(res), flush=True)
    report = {"benchmark": "P5 route path", "workload": w, "copy_bandwidth_GBps": bw / 1e9,
              "machine": machine_info(), "host_GiB": host_bytes() / 2**30, "results": rows,
              "ratios": ratios(rows)}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        for key, r in report["ratios"].items():
            print(key, json.dumps(r))
    if args.plot:
        plot(rows, args.plot)
    return report


def _line(r: dict) -> str:
    head = f"{r['arm']:<15}{r['dist']:<12}{r['trajectories']:>6} x {r['max_len']:<6}{r['tokens'] / 1e6:>8.2f} M tok"
    if "error" in r:
        return f"{head}  {r['error']}"
    extra = "".join(f"  {k}={r[k]:.2f}s" for k in ("batch_s", "rank_s") if k in r)
    return (f"{head}{r['wall_s']:>9.2f} s  added RSS {r['added_rss'] / 2**30:7.2f} GiB  "
            f"floor {r['floor_s']:.2f} s ({r['wall_s'] / r['floor_s']:.1f}x){extra}")


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table (docs/benchmarks.md)."""
    out = ["| trajectories x max tokens | dist | tokens | arm | wall s | peak RSS added GiB | floor s | "
           "wall / floor | notes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['trajectories']} x {r['max_len']} | {r['dist']} | {r['tokens'] / 1e6:.2f} M | {r['arm']} |"
        if "error" in r:
            out.append(f"{head} - | - | {r['floor_s']:.2f} | - | {r['error']} |")
            continue
        notes = ", ".join(f"{k[:-2]} {r[k]:.2f} s" for k in ("batch_s", "rank_s") if k in r)
        if "rank_part" in r:
            notes += f"; rank part {r['rank_part']}"
        out.append(f"{head} {r['wall_s']:.2f} | {r['added_rss'] / 2**30:.2f} | {r['floor_s']:.2f} | "
                   f"{r['wall_s'] / r['floor_s']:.1f} | {notes} |")
    return "\n".join(out)


def ratios(rows: list[dict]) -> dict:
    """Per (size, dist) and r3bridge arm: its time and peak RSS added over SkyRL's collation's, its
    time over the floor (one copy of the packed bytes), and whether the goals are met (adapter
    arms: <= 1/3 of SkyRL's time, <= 1/4 of its RAM, <= 2x the floor; the whole-batch build: no
    slower than SkyRL's collation)."""
    out = {}
    key = lambda r: (r["trajectories"], r["max_len"], r["dist"])     # noqa: E731
    by = {}
    for r in rows:
        if "error" not in r:
            by.setdefault(key(r), {})[r["arm"]] = r
    for k, arms in by.items():
        sk = arms.get("skyrl")
        d = {}
        for name, r in arms.items():
            if not name.startswith("r3bridge"):
                continue
            e = {"time_over_floor": r["wall_s"] / r["floor_s"]}
            if sk:
                e["time_over_skyrl"] = r["wall_s"] / sk["wall_s"]
                e["rss_over_skyrl"] = r["added_rss"] / max(sk["added_rss"], 1)
            if name == "r3bridge_batch" and sk:
                e["build_time_over_skyrl"] = r["batch_s"] / sk["wall_s"]
                e["goal_met"] = e["build_time_over_skyrl"] <= 1
            elif sk:
                e["goal_met"] = (e["time_over_skyrl"] <= 1 / 3 and e["rss_over_skyrl"] <= 0.25
                                 and e["time_over_floor"] <= 2)
            d[name] = {x: round(v, 4) if isinstance(v, float) else v for x, v in e.items()}
        out["%dx%d/%s" % k] = d
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = sorted({r["dist"] for r in rows}, key=list(SPREAD).index)
    fig, axes = plt.subplots(2, len(dists), figsize=(4.2 * len(dists), 7), squeeze=False)
    for j, dist in enumerate(dists):
        for arm in ARMS:
            pts = sorted((r["tokens"], r["wall_s"], r["added_rss"] / 2**30, r["floor_s"]) for r in rows
                         if r["dist"] == dist and r["arm"] == arm and "error" not in r)
            if not pts:
                continue
            x = [p[0] for p in pts]
            line, = axes[0][j].loglog(x, [p[1] for p in pts], "o-", label=arm)
            axes[0][j].loglog(x, [p[3] for p in pts], ":", color=line.get_color(), alpha=0.6)
            axes[1][j].loglog(x, [max(p[2], 1e-3) for p in pts], "o-", label=arm)
        axes[0][j].set_title(f"{dist}: wall time (dotted: bandwidth floor)", fontsize=9)
        axes[1][j].set_title(f"{dist}: peak RSS added over the input", fontsize=9)
        axes[1][j].set_xlabel("tokens in the batch")
        axes[0][j].set_ylabel("s")
        axes[1][j].set_ylabel("GiB")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
