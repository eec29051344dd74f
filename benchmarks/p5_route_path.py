"""P5: the route path at production shape, engine output -> what one rank consumes, side by side.

The same engine output (per-trajectory route arrays as vLLM returns them: numpy
``[tokens - 1, num_hidden_layers, K]``, dense layers as zero rows, read-only; built as SkyRL 0.4's
``bench_packed_route_collation.py`` builds its input: views of one template, so allocating the
source does not dominate) goes through each arm in its own process (peak RSS is the arm's own;
"added" = peak minus the RSS after the input was built):

* ``skyrl``: SkyRL 0.4.0's packed collation, ``skyrl/train/dataset/preprocess.py:
  _collate_rollout_expert_indices`` from the wheel (serial fill of one ``[sum(len), L, K]``
  buffer; 0.4.0 ships no pooled fill: its benchmark imports ``skyrl.train.dataset.parallel_fill``,
  which the wheel lacks). It packs what it is given: all ``num_hidden_layers`` layers.
* ``verl``: verl 0.9.1's path: the agent loop's per-sample int16 ``[1, prompt + response, L, K]``
  (``verl/experimental/agent_loop/agent_loop.py``, inline code there: replicated, right padding),
  their concatenation (``_postprocess``, inline), verl's ``unpad_input`` / ``index_first_axis``
  into the jagged nested tensor (what ``left_right_2_no_padding`` does to ``routed_experts``; the
  torch implementations ``_fallback_unpad_input`` / ``_fallback_index_first_axis``, which verl's
  dispatchers pick without flash-attn),
  then per micro-batch ``preprocess_thd_engine`` + the SP slice + ``.to(int64)`` per stage layer
  (as ``set_router_replay_data``; only where megatron-core imports). Skipped, with the size it
  would need, where its padded buffers cannot fit the host.
* ``r3bridge_batch``: ``ReplayBatch.from_vllm`` (the whole-batch canonical build: MoE layers only,
  uint8) then, per micro-batch, ``shard`` of that micro-batch's sequences for the rank.
* ``r3bridge_rank``: ``r3bridge.rank_targets`` per micro-batch, straight from the
  engine arrays (no whole-batch buffer).

The rank: tp 0, cp 0 of pp stage ``--pp-rank`` (the stage with the most MoE layers) of TP4 x CP2 x
PP4 (SP on), 48 decoder layers of which the first 8 are dense, top-22 of 128 experts. Micro-batches:
consecutive trajectories up to ``--mb-tokens`` tokens; a rank holds one micro-batch's int64 targets
at a time. Each arm also gets its memory-bandwidth floor: the bytes it must read and write at least
/ the copy bandwidth measured on the same machine (a multi-threaded ``copy_`` of 2 GiB).

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
ARMS = ("skyrl", "verl", "r3bridge_batch", "r3bridge_rank")


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
    tmpl.flags.writeable = False
    return [tmpl[:int(n) - 1] for n in lens]


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
def arm_skyrl(items, lens, w, mbs, lay):
    sys.path.insert(0, str(HERE))
    from _common import load_skyrl04_preprocess

    pre = load_skyrl04_preprocess(w["skyrl04"])
    t0 = time.perf_counter()
    packed = pre._collate_rollout_expert_indices(items, lens)
    t = time.perf_counter() - t0
    return {"wall_s": t, "out_bytes": packed.values.numel() * packed.values.element_size()
            if hasattr(packed, "values") else None}


def arm_verl(items, lens, w, mbs, lay):
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


def arm_r3bridge_batch(items, lens, w, mbs, lay):
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


def arm_r3bridge_rank(items, lens, w, mbs, lay):
    from r3bridge import rank_targets

    moe = lay.moe_layer_ids
    t0 = time.perf_counter()
    rows = 0
    for a, b in mbs:
        t = rank_targets(items[a:b], lay, lens[a:b].tolist(), num_experts=w["experts"], moe_layer_ids=moe,
                         pp_rank=w["pp_rank"])
        rows += t.num_rows
        del t
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
    # warm-up on a tiny batch: imports and first-call setup (torch's nested tensors, verl's
    # modules) are neither the arm's time nor its memory
    tiny = np.array([64, 48], dtype=np.int64)
    arm(engine_output(tiny, w), tiny, w, [(0, 2)], lay)
    base = rss_bytes()
    out = arm(items, lens, w, mbs, lay)
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
    """Bytes an arm must read + write at least."""
    rows = int((lens - 1).sum())
    tokens = int(lens.sum())
    k, nl_all, nl_moe = w["topk"], w["layers"], w["layers"] - w["dense"]
    item = np.dtype(w["dtype"]).itemsize
    stage = len(lay.moe_layers(w["pp_rank"]))
    rank_rows = tokens // (w["cp"] * w["tp"])          # before packing alignment
    if arm == "skyrl":          # read every layer, write the packed buffer (its dtype)
        return rows * nl_all * k * item + tokens * nl_all * k * item
    if arm == "verl":           # read, write int16 padded, read it, write the unpadded int16 copy
        return rows * nl_all * k * item + 3 * len(lens) * int(lens.max()) * nl_all * k * 2
    if arm == "r3bridge_batch":     # read the MoE layers, write them uint8 (the rank part: below)
        return rows * nl_moe * k * item + rows * nl_moe * k + rank_rows * stage * k * 8
    return rank_rows * stage * k * (item + 8)     # read the rank's ids, write its int64 targets


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
    ap.add_argument("--arms", default=",".join(ARMS))
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
         "seed": args.seed, "dtype": args.dtype, "skyrl04": args.skyrl04}
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
    """Per (size, dist): r3bridge_rank vs SkyRL (RAM, time), vs its floor; r3bridge's whole-batch
    build vs SkyRL's collation."""
    out = {}
    key = lambda r: (r["trajectories"], r["max_len"], r["dist"])     # noqa: E731
    by = {}
    for r in rows:
        if "error" not in r:
            by.setdefault(key(r), {})[r["arm"]] = r
    for k, arms in by.items():
        sk, rk, bt = arms.get("skyrl"), arms.get("r3bridge_rank"), arms.get("r3bridge_batch")
        d = {}
        if sk and rk:
            d["rank_rss_over_skyrl"] = rk["added_rss"] / max(sk["added_rss"], 1)
            d["rank_time_over_skyrl"] = rk["wall_s"] / sk["wall_s"]
        if rk:
            d["rank_time_over_floor"] = rk["wall_s"] / rk["floor_s"]
        if sk and bt:
            d["batch_build_time_over_skyrl"] = bt["batch_s"] / sk["wall_s"]
            d["batch_rss_over_skyrl"] = bt["added_rss"] / max(sk["added_rss"], 1)
        if sk and rk:
            d["goals_met"] = (d["rank_rss_over_skyrl"] <= 0.25 and d["rank_time_over_skyrl"] <= 1 / 3
                              and d["rank_time_over_floor"] <= 2
                              and (not bt or d.get("batch_build_time_over_skyrl", 9) <= 1))
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
