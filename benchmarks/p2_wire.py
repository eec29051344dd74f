"""P2: bytes on the wire per sample, rollout -> trainer.

* r3bridge: ``ReplayBatch.nbytes`` (== ``len(to_bytes())``, checked): ragged rows
  (prompt + completion - 1 per sample), MoE layers only, uint8 up to 256 experts (int16 above),
  1 validity bit per row, a small header;
* verl 0.9.1: ``routed_experts`` as the agent loop ships it: int16, every decoder layer (dense
  ones as zero rows), one row per token, padded to the batch's longest sample
  (``[bs, max_len, num_layers, topk]``; tensor bytes, pickling overhead not counted);
* SGLang: ``meta_info["routed_experts"]``: base64 of flat int32, every decoder layer,
  prompt + completion - 1 rows (the exact ``len(base64.b64encode(...))``).

It also times ``ReplayBatch.from_bytes`` of the whole batch and the part of it that the payload's
CRC32 checksums take (``zlib.crc32`` over the same bytes, single-threaded, median of a few runs).

Not a test: prints a table, or one JSON object with ``--json``.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import zlib

import numpy as np
import torch
from _common import machine_info

WORKLOADS = [
    # name, experts, decoder layers, dense-first layers, topk
    ("64 experts, 48 layers (3 dense), top-8", 64, 48, 3, 8),
    ("128 experts, 48 layers (3 dense), top-8", 128, 48, 3, 8),
    ("256 experts, 61 layers (3 dense), top-8 (DeepSeek-V3-like)", 256, 61, 3, 8),
    ("384 experts, 48 layers (1 dense), top-8", 384, 48, 1, 8),
]


def sample_lengths(rng, n):
    """Mixed lengths: prompts 64..4096, completions 16..16384 (log-uniform)."""
    prompts = np.exp(rng.uniform(np.log(64), np.log(4096), n)).astype(int)
    completions = np.exp(rng.uniform(np.log(16), np.log(16384), n)).astype(int)
    return prompts.tolist(), completions.tolist()


def _median_s(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(name, E, L, dense, K, prompts, completions, seed=0):
    import r3bridge

    rng = np.random.default_rng(seed)
    moe = list(range(dense, L))
    rows = [p + c - 1 for p, c in zip(prompts, completions)]
    arrays = []
    for r in rows:    # distinct ids per row: random offset + stride coprime with E
        off = rng.integers(0, E, (r, len(moe), 1))
        arrays.append(((off + np.arange(K) * 5) % E).astype(np.uint8 if E <= 256 else np.uint16))
    rb = r3bridge.ReplayBatch.from_ragged(arrays, num_experts=E, layer_ids=moe, engine="vllm")
    wire = rb.to_bytes()
    assert rb.nbytes == len(wire)
    n = len(rows)
    single = [r3bridge.ReplayBatch.from_ragged([a], num_experts=E, layer_ids=moe, engine="vllm").nbytes
              for a in arrays[:4]]
    max_len = max(p + c for p, c in zip(prompts, completions))
    verl = n * max_len * L * K * 2
    # SGLang: exact base64 length of each sample's flat int32 buffer; checked on one sample
    sgl = [4 * ((r * L * K * 4 + 2) // 3) for r in rows]
    full0 = np.zeros((rows[0], L, K), dtype=np.int32)
    full0[:, dense:] = arrays[0]
    assert len(base64.b64encode(full0.tobytes())) == sgl[0]
    tokens = sum(p + c for p, c in zip(prompts, completions))
    decode_s = _median_s(lambda: r3bridge.ReplayBatch.from_bytes(wire), 3)
    crc_s = _median_s(lambda: zlib.crc32(wire), 5)
    return {
        "workload": name, "experts": E, "layers": L, "dense_layers": dense, "moe_layers": len(moe),
        "topk": K, "samples": n, "mean_tokens": tokens / n, "max_tokens": max_len,
        "route_dtype": str(rb.routes.dtype).replace("torch.", ""),
        "bytes_per_sample": {"r3bridge": len(wire) / n, "verl": verl / n, "sglang": sum(sgl) / n},
        # header + bit mask of a one-sample payload, beyond its route bytes
        "r3bridge_single_sample_overhead_bytes": [s - a.shape[0] * a.shape[1] * a.shape[2] * rb.routes.element_size()
                                                  for s, a in zip(single, arrays)],
        "from_bytes_s": decode_s, "crc32_s": crc_s, "crc32_share_of_from_bytes": crc_s / decode_s,
        "ratios": {"verl_over_r3bridge": verl / len(wire), "sglang_over_r3bridge": sum(sgl) / len(wire)},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    mixes = {"mixed": sample_lengths(rng, args.samples),
             # no padding at all: verl's worst case for our ratio (equal lengths, 1024 + 3072)
             "equal": ([1024] * args.samples, [3072] * args.samples)}
    rows = []
    for mix, (prompts, completions) in mixes.items():
        for w in WORKLOADS:
            r = measure(*w, prompts, completions, seed=args.seed)
            r["lengths"] = mix
            small = r["experts"] <= 256
            r["goal"] = "verl >= 2x and sglang >= 5x" if small else "n/a (> 256 experts)"
            r["goal_met"] = (r["ratios"]["verl_over_r3bridge"] >= 2
                             and r["ratios"]["sglang_over_r3bridge"] >= 5) if small else None
            rows.append(r)
    report = {"benchmark": "P2 wire bytes", "machine": machine_info(), "samples": args.samples,
              "lengths": {k: {"prompt": v[0], "completion": v[1]} for k, v in mixes.items()},
              "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return report
    print(f"P2 wire bytes per sample | {args.samples} samples per batch | torch {torch.__version__}")
    for mix in mixes:
        sel = [r for r in rows if r["lengths"] == mix]
        print(f"\n{mix} lengths: mean {sel[0]['mean_tokens']:.0f} tokens, max {sel[0]['max_tokens']}")
        print(f"{'workload':<58}{'r3bridge':>12}{'verl':>12}{'sglang':>12}{'verl/r3b':>10}{'sgl/r3b':>10}{'decode':>10}{'crc':>7}  goal")
        for r in sel:
            b = r["bytes_per_sample"]
            goal = "-" if r["goal_met"] is None else ("met" if r["goal_met"] else "NOT met")
            print(f"{r['workload']:<58}{b['r3bridge'] / 1e6:>10.2f}MB{b['verl'] / 1e6:>10.2f}MB"
                  f"{b['sglang'] / 1e6:>10.2f}MB{r['ratios']['verl_over_r3bridge']:>9.2f}x"
                  f"{r['ratios']['sglang_over_r3bridge']:>9.2f}x{r['from_bytes_s'] * 1e3:>8.1f}ms"
                  f"{100 * r['crc32_share_of_from_bytes']:>6.1f}%  {goal}")
    return report


if __name__ == "__main__":
    main()
