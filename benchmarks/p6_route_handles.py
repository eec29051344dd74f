"""P6: routes by reference. Bytes moved to, and time for, ONE trainer rank, with route handles vs
the whole ``routed_experts`` field of its samples, side by side in one run.

The engine output is P5's (``p5_route_path.engine_output``: per trajectory ``[tokens - 1, L, K]``,
SkyRL 0.4's length distributions). A "rollout" process writes it once, both ways, to the same
store (a folder, by default under ``/dev/shm``: node-local shared memory):

* ``whole``: each trajectory's whole field as a framework moves it (one ``.npy`` per sample, every
  layer, every token): what verl 0.9.1's TransferQueue ``kv_batch_get`` / SkyRL's controller hand
  every worker today (the worker receives its samples' whole field, a copy of every byte);
* ``handles``: :class:`r3bridge.handles.RouteStore` over :class:`r3bridge.handles.FileRoutes`
  (layer-major, a crc32 per (layer, 256-row block)); the batch carries pickled handles only.

Then each arm runs in its own process (peak RSS is its own: "added" = peak minus the RSS before
its first micro-batch, the peak reset there through ``/proc/self/clear_refs``) as one rank, tp 0 / cp 0 of pp stage ``--pp-rank`` of TP4 x CP2 x PP4 (SP
on), every micro-batch of up to ``--mb-tokens`` tokens:

* ``whole``: read its samples' whole field from the store, then ``r3bridge.rank_targets`` (the one
  reader on engine arrays: the rank's rows of its stage's layers);
* ``handles``: ``r3bridge.handles.read_rank_targets``: only the digest blocks holding the rank's
  rows of its stage's layers are read and checked, then the same reader.

Both arms' targets are compared (a crc32 of each micro-batch's int64 targets and masks, outside the
timed part). The rank's *share*: its token rows x its stage's MoE layers x K x itemsize. Not a test:
prints a table, or one JSON object with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from p5_route_path import engine_output, layout_of, lengths_of, micro_batches, peak_rss_bytes, rss_bytes  # noqa: E402


def _workload(a) -> dict:
    return dict(layers=a.layers, dense=a.dense, topk=a.topk, experts=a.experts, dtype=a.dtype, tp=a.tp, cp=a.cp,
                pp=a.pp, ep=1, seed=a.seed, pp_rank=a.pp_rank, mb_tokens=a.mb_tokens, n=a.trajectories,
                max_len=a.max_tokens, dist=a.dist, block_rows=a.block_rows, store=a.store)


def _inputs(w: dict):
    w = dict(w, dtype=np.dtype(w["dtype"]))
    lens = lengths_of(w["dist"], w["n"], w["max_len"], w["seed"])
    return w, lens, engine_output(lens, w)


def _lens(w: dict):
    w = dict(w, dtype=np.dtype(w["dtype"]))
    return w, lengths_of(w["dist"], w["n"], w["max_len"], w["seed"])


def _reset_peak() -> int:
    """This process's RSS now, its peak (VmHWM) reset to it, so that the arm's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss_bytes()


def _digest(t) -> int:
    crc = zlib.crc32(t.valid.numpy().tobytes())
    for lid in t.layer_ids:
        crc = zlib.crc32(t.indices[lid].numpy().tobytes(), crc)
    return crc


# ------------------------------------------------------------------------------ processes
def role_write(w: dict) -> dict:
    """The rollout side: the engine arrays written once, as the whole field and as handles."""
    from r3bridge.handles import FileRoutes, RouteStore

    w, lens, items = _inputs(w)
    root = Path(w["store"])
    (root / "whole").mkdir(parents=True, exist_ok=True)
    moe = layout_of(w).moe_layer_ids
    t0 = time.perf_counter()
    for i, a in enumerate(items):
        np.save(root / "whole" / f"{i}.npy", a)
    whole_s = time.perf_counter() - t0
    store = RouteStore(FileRoutes(str(root / "handles")), block_rows=w["block_rows"])
    t0 = time.perf_counter()
    handles = [store.put(f"traj-{i}", a[:, w["dense"]:], moe, step=0, num_experts=w["experts"])
               for i, a in enumerate(items)]
    handles_s = time.perf_counter() - t0
    blob = pickle.dumps({"run_id": store.run_id, "handles": handles})
    (root / "handles.pkl").write_bytes(blob)
    return {"write_whole_s": whole_s, "write_handles_s": handles_s, "route_bytes": int(sum(a.nbytes for a in items)),
            "handle_bytes": len(blob), "handle_bytes_each": len(pickle.dumps(handles[0]))}


def role_whole(w: dict) -> dict:
    import torch

    from r3bridge import rank_targets

    w, lens = _lens(w)
    lay = layout_of(w)
    root = Path(w["store"]) / "whole"
    mbs = micro_batches(lens, w["mb_tokens"])
    rank_targets([np.load(root / "0.npy")[:64]], lay, [65], num_experts=w["experts"], pp_rank=w["pp_rank"],
                 moe_layer_ids=lay.moe_layer_ids)                  # warm-up: imports, first calls
    base, received, rows, wall, digests = _reset_peak(), 0, 0, 0.0, []
    for a, b in mbs:
        t0 = time.perf_counter()
        items = [np.load(root / f"{i}.npy") for i in range(a, b)]
        received += sum(x.nbytes for x in items)
        t = rank_targets(items, lay, lens[a:b].tolist(), num_experts=w["experts"], moe_layer_ids=lay.moe_layer_ids,
                         pp_rank=w["pp_rank"], device=torch.device("cpu"))
        wall += time.perf_counter() - t0
        rows += int(t.num_valid)
        digests.append(_digest(t))
        del items, t
    return {"wall_s": wall, "bytes_received": received, "valid_rows": rows, "digests": digests,
            "added_rss": peak_rss_bytes() - base, "micro_batches": len(mbs)}


def role_handles(w: dict) -> dict:
    from r3bridge.handles import FileRoutes, HandleReads, read_rank_targets

    w, lens = _lens(w)
    lay = layout_of(w)
    root = Path(w["store"])
    mbs = micro_batches(lens, w["mb_tokens"])
    resolvers = {"files": FileRoutes(str(root / "handles"))}
    t0 = time.perf_counter()
    got = pickle.loads((root / "handles.pkl").read_bytes())
    unpickle_s = time.perf_counter() - t0
    run_id, handles = got["run_id"], got["handles"]
    n0 = handles[0].start_row + handles[0].rows + 1
    read_rank_targets(handles[:1], resolvers, lay, [n0], run_id=run_id, step=0, pp_rank=w["pp_rank"])    # warm-up
    base, rows, wall, digests, stats = _reset_peak(), 0, unpickle_s, [], HandleReads()
    for a, b in mbs:
        t0 = time.perf_counter()
        t = read_rank_targets(handles[a:b], resolvers, lay, lens[a:b].tolist(), run_id=run_id, step=0,
                              pp_rank=w["pp_rank"], stats=stats)
        wall += time.perf_counter() - t0
        rows += int(t.num_valid)
        digests.append(_digest(t))
        del t
    return {"wall_s": wall, "bytes_received": stats.bytes_read + stats.table_bytes, "route_bytes_read": stats.bytes_read,
            "table_bytes": stats.table_bytes, "valid_rows": rows, "digests": digests,
            "added_rss": peak_rss_bytes() - base, "micro_batches": len(mbs)}


def _run(role: str, w: dict, timeout: int) -> dict:
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--role", role, json.dumps(w)],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        return {"error": f"exit {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])}
    return json.loads(p.stdout.strip().splitlines()[-1])


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The production-shape workload both P6 benchmarks take (p6_transport.py too)."""
    ap.add_argument("--trajectories", type=int, default=64, help="the replica's samples (its DP shard)")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--dist", default="typical_rl")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--dense", type=int, default=0, help="first DENSE decoder layers are dense")
    ap.add_argument("--topk", type=int, default=22)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dtype", default="int16", choices=["uint8", "int16"])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--mb-tokens", type=int, default=65536)
    ap.add_argument("--block-rows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--pp-rank", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--role", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role:
        print(json.dumps(globals()["role_" + a.role[0]](json.loads(a.role[1]))))
        return {}
    a.store = tempfile.mkdtemp(prefix="r3bridge-p6-", dir=a.store_dir)
    w = _workload(a)
    try:
        out = {"workload": {k: v for k, v in w.items() if k != "store"}, "write": _run("write", w, a.timeout)}
        out["whole"] = _run("whole", w, a.timeout)
        out["handles"] = _run("handles", w, a.timeout)
    finally:
        shutil.rmtree(a.store, ignore_errors=True)
    from _common import machine_info

    out["machine"] = machine_info()
    wh, hd = out["whole"], out["handles"]
    if "error" not in wh and "error" not in hd:
        lens = lengths_of(a.dist, a.trajectories, a.max_tokens, a.seed)
        lay = layout_of(dict(w, dtype=np.dtype(a.dtype)))
        stage_layers = len(lay.moe_layers(a.pp_rank))
        itemsize = np.dtype(a.dtype).itemsize
        share = hd["valid_rows"] * stage_layers * a.topk * itemsize
        out["summary"] = {
            "tokens": int(lens.sum()), "targets_equal": wh["digests"] == hd["digests"],
            "rank_share_bytes": share,
            "whole_over_share": wh["bytes_received"] / share, "handles_over_share": hd["bytes_received"] / share,
            "bytes_ratio_whole_over_handles": wh["bytes_received"] / hd["bytes_received"],
            "time_ratio_whole_over_handles": wh["wall_s"] / hd["wall_s"],
        }
        for r in (wh, hd):
            r.pop("digests")
    if a.json:
        print(json.dumps(out))
    else:
        print(markdown(out))
    return out


def markdown(out: dict) -> str:
    gib = 1 << 30
    w, s = out["workload"], out.get("summary", {})
    lines = [f"{w['n']} trajectories x <= {w['max_len']} tokens ({w['dist']}, {s.get('tokens', '?')} tokens), "
             f"{w['layers']} layers, top-{w['topk']}, {w['dtype']}; rank tp0 cp0 pp{w['pp_rank']} of "
             f"TP{w['tp']} x CP{w['cp']} x PP{w['pp']}; write: {json.dumps(out['write'])}",
             "", "| arm | bytes to the rank | x its share | time | peak RSS added |", "|---|---|---|---|---|"]
    for arm in ("whole", "handles"):
        r = out[arm]
        if "error" in r:
            lines.append(f"| {arm} | {r['error']} | | | |")
            continue
        lines.append(f"| {arm} | {r['bytes_received'] / gib:.3f} GiB | "
                     f"{r['bytes_received'] / s['rank_share_bytes']:.2f} | {r['wall_s']:.2f} s | "
                     f"{r['added_rss'] / gib:.3f} GiB |")
    lines.append(f"\nratios whole / handles: bytes {s.get('bytes_ratio_whole_over_handles', float('nan')):.1f}x, "
                 f"time {s.get('time_ratio_whole_over_handles', float('nan')):.1f}x; targets equal: "
                 f"{s.get('targets_equal')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
