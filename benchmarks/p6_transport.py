"""P6, end to end: one RL step's routes from the engine's arrays to every rank's router targets,
through each framework's own transport as it runs, and through route handles, side by side in one
run on a local Ray cluster (issue 47 item 5).

A "rollout" actor holds the engine's output (P5's ``engine_output``: per trajectory
``[tokens - 1, L, K]``, vLLM's ``routed_experts``); R "rank" actors stand for R trainer ranks of
one data-parallel replica of TP x CP x PP (SP on); the driver is the trainer's controller. The
clock starts when the rollout hands its arrays over and stops when the last rank holds the targets
of every micro-batch of the step (the crc32 of each rank's targets that compares the arms is timed
and left out). Imports, Ray actors and TransferQueue's client are made before it. Arms:

* ``tq`` (verl 0.9.1's TransferQueue 0.1.11, ``SimpleStorage``): the rollout side
  ``kv_batch_put``s the field (``list_of_dict_to_tensordict``, as verl's ``AgentLoopWorkerTQ``
  does); the controller passes the keys; every rank ``kv_batch_get``s its samples' whole
  ``routed_experts`` (``tqbridge``'s per-worker get), then ``r3bridge.rank_targets``;
* ``controller`` (SkyRL's path): the rollout returns its arrays to the controller (``ray.get``:
  the generator output in the trainer's process), which ``ray.put``s the replica's batch once;
  every rank ``ray.get``s it (zero-copy on this node), then ``r3bridge.rank_targets``;
* ``handles-files`` / ``handles-ray``: the rollout writes each sample once through
  ``r3bridge.handles.RouteStore`` (``FileRoutes`` under ``/dev/shm``, or ``RayRoutes``) and returns
  the handles; the controller passes them; every rank runs ``read_rank_targets`` (only its rows of
  its stage's layers, every digest block it reads checked). ``--write-threads`` (default: the
  host's CPUs) threads write the samples.

Reported per arm: the step's end-to-end seconds, route bytes each rank received (and x its share:
its rows x its stage's MoE layers x K x itemsize), route bytes through the controller and through
storage processes, the ranks' added peak RSS, the node's peak memory added; the targets of every
rank are compared across arms (a crc32 per micro-batch). The handles arms also report their phases:
the write's wall time and its copy / digest / store seconds summed over the writer's threads
(``write_s``, ``write_phases``), the handles' trip to the controller (``handles_at_controller_s``)
and per rank (``ranks[i].phases``) the trip from the write's end to the rank's start, the seconds
opening handles, reading and checking its blocks, and the rest of the one reader (row map,
targets). Not a test: prints a table or ``--json``.

``--write-only``: the handles-files write alone, no Ray (``RouteStore.put_many`` of the step's samples
to ``FileRoutes`` under ``--store-dir`` on ``--write-threads`` threads, ``--repeats`` times): its wall
time, GiB/s and copy / digest / store seconds summed over the threads, per repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from p5_route_path import engine_output, layout_of, lengths_of, micro_batches, peak_rss_bytes  # noqa: E402
from p6_route_handles import _digest, _reset_peak, add_workload_args  # noqa: E402  (one rank's targets' crc32; the peak RSS reset)

ARMS = ("tq", "controller", "handles-files", "handles-ray")


def rank_coords(w: dict) -> list[tuple[int, int, int]]:
    """The replica's ranks in an order that spreads a prefix over stages and CP ranks first
    (``--ranks R`` takes the first R): (tp, cp, pp)."""
    out = [(tp, cp, pp) for tp in range(w["tp"]) for cp in range(w["cp"]) for pp in range(w["pp"])]
    return out[: w["ranks"]]


def share_bytes(w: dict, lens: np.ndarray, coord) -> int:
    """The rank's share of the step's ids: its token rows (1 / (TP x CP) of every sequence under SP
    and CP) x its stage's MoE layers x K x itemsize."""
    lay = layout_of(w)
    layers = len(lay.moe_layers(coord[2], 0))
    rows = int(lens.sum()) // (w["tp"] * w["cp"])
    return rows * layers * w["topk"] * np.dtype(w["dtype"]).itemsize


# ------------------------------------------------------------------------------ the actors' work
def _warm_imports(arm: str) -> None:
    """Imports and the TransferQueue client made before the clock starts (set-up, not the step's)."""
    if arm == "tq":
        import transfer_queue as tq
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: F401

        tq.init()
    else:
        import r3bridge.handles  # noqa: F401

def _timed_digest(t, spent: list) -> int:
    """The targets' crc32 (compared across arms), its seconds added to ``spent[0]``: the rank's
    clock excludes it (it checks the benchmark, it is no part of the step)."""
    t0 = time.perf_counter()
    crc = _digest(t)
    spent[0] += time.perf_counter() - t0
    return crc


def _targets_of(w: dict, lens: np.ndarray, coord, items_of, spent: list) -> tuple[list[int], int]:
    """``items_of(a, b)`` -> the engine arrays of samples [a, b); every micro-batch's targets."""
    import torch

    from r3bridge import rank_targets

    lay = layout_of(w)
    tp, cp, pp = coord
    digests, rows = [], 0
    for a, b in micro_batches(lens, w["mb_tokens"]):
        t = rank_targets(items_of(a, b), lay, lens[a:b].tolist(), num_experts=w["experts"],
                         moe_layer_ids=lay.moe_layer_ids, tp_rank=tp, cp_rank=cp, pp_rank=pp,
                         device=torch.device("cpu"))
        digests.append(_timed_digest(t, spent))
        rows += int(t.num_valid)
    return digests, rows


class Rollout:
    """The engine side: holds the step's arrays (made before the clock starts)."""

    def __init__(self, w: dict) -> None:
        self.w = dict(w, dtype=np.dtype(w["dtype"]))
        self.lens = lengths_of(w["dist"], w["n"], w["max_len"], w["seed"])
        self.items = [np.ascontiguousarray(a) for a in engine_output(self.lens, self.w)]
        self.store = None
        _warm_imports(w["arm"])

    def ready(self) -> int:
        return int(sum(a.nbytes for a in self.items))

    def tq_put(self) -> float:
        import torch
        import transfer_queue as tq
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        tq.init()
        t0 = time.perf_counter()
        fields = list_of_dict_to_tensordict([{"routed_experts": torch.from_numpy(a)} for a in self.items])
        tq.kv_batch_put(keys=[f"s{i}" for i in range(len(self.items))], partition_id="train", fields=fields)
        return time.perf_counter() - t0

    def arrays(self) -> list[np.ndarray]:
        return self.items

    def write_handles(self, backend: str, root: str) -> dict:
        from r3bridge.handles import FileRoutes, RayRoutes, RouteStore, SampleRoutes

        lay = layout_of(self.w)
        self.store = RouteStore(FileRoutes(root) if backend == "files" else RayRoutes(), block_rows=self.w["block_rows"],
                                workers=self.w["write_threads"])    # as SkyRL's driver writes a batch
        t0 = time.perf_counter()
        handles = self.store.put_many([SampleRoutes(f"traj-{i}", a[:, self.w["dense"]:], lay.moe_layer_ids, 0,
                                                    self.w["experts"]) for i, a in enumerate(self.items)], step=1)
        # returned as objects: Ray serialises the handles' object references with their owner (a
        # plain pickle of a reference is not tracked, and the reader's get of it times out)
        return {"run_id": self.store.run_id, "handles": handles, "write_s": time.perf_counter() - t0,
                "write_phases": self.store.times.as_dict(), "written_at": time.time()}


class Rank:
    """One trainer rank of the replica."""

    def __init__(self, w: dict, coord) -> None:
        self.w = dict(w, dtype=np.dtype(w["dtype"]))
        self.coord = tuple(coord)
        self.lens = lengths_of(w["dist"], w["n"], w["max_len"], w["seed"])
        # warm-up outside the clock: imports and first calls of the reader
        from r3bridge import rank_targets

        lay = layout_of(self.w)
        probe = np.zeros((64, self.w["layers"], self.w["topk"]), self.w["dtype"])
        probe[:] = np.arange(self.w["topk"], dtype=self.w["dtype"])
        rank_targets([probe], lay, [65], num_experts=self.w["experts"], moe_layer_ids=lay.moe_layer_ids,
                     pp_rank=self.coord[2])
        _warm_imports(w["arm"])
        self.base = _reset_peak()

    def pid(self) -> int:
        return os.getpid()

    def _done(self, digests, rows, received, t_in, spent) -> dict:
        return {"coord": self.coord, "digests": digests, "valid_rows": rows, "bytes_received": int(received),
                "get_s": t_in, "done_at": time.time() - spent[0], "digest_s": spent[0],
                "added_rss": peak_rss_bytes() - self.base}

    def via_tq(self, n: int) -> dict:
        import transfer_queue as tq

        tq.init()
        t0 = time.perf_counter()
        data = tq.kv_batch_get(keys=[f"s{i}" for i in range(n)], partition_id="train", select_fields=["routed_experts"])
        field = data["routed_experts"]
        items = [x.numpy() for x in field.unbind(0)]
        t_in, spent = time.perf_counter() - t0, [0.0]
        digests, rows = _targets_of(self.w, self.lens, self.coord, lambda a, b: items[a:b], spent)
        return self._done(digests, rows, sum(x.nbytes for x in items), t_in, spent)

    def via_ref(self, ref_box) -> dict:
        import ray

        t0 = time.perf_counter()
        items = ray.get(ref_box[0])
        t_in, spent = time.perf_counter() - t0, [0.0]
        digests, rows = _targets_of(self.w, self.lens, self.coord, lambda a, b: items[a:b], spent)
        return self._done(digests, rows, sum(x.nbytes for x in items), t_in, spent)

    def via_handles(self, got: dict, backend: str, root: str) -> dict:
        import torch

        from r3bridge.handles import FileRoutes, HandleReads, RayRoutes, read_rank_targets

        started_at, t0 = time.time(), time.perf_counter()
        resolvers = {"files": FileRoutes(root)} if backend == "files" else {"ray": RayRoutes()}
        lay = layout_of(self.w)
        tp, cp, pp = self.coord
        stats, digests, rows, spent = HandleReads(), [], 0, [0.0]
        for a, b in micro_batches(self.lens, self.w["mb_tokens"]):
            t = read_rank_targets(got["handles"][a:b], resolvers, lay, self.lens[a:b].tolist(), run_id=got["run_id"],
                                  step=1, tp_rank=tp, cp_rank=cp, pp_rank=pp, stats=stats, device=torch.device("cpu"))
            digests.append(_timed_digest(t, spent))
            rows += int(t.num_valid)
        out = self._done(digests, rows, stats.bytes_read + stats.table_bytes, 0.0, spent)
        total = time.perf_counter() - t0 - spent[0]
        # the rank's phases: the handles' trip (the write's end to this call), opening handles,
        # reading and checking its blocks, the rest of the one reader (row map, targets)
        out["phases"] = {"trip_s": started_at - got["written_at"], "open_s": stats.open_s, "read_s": stats.read_s,
                         "check_s": stats.check_s, "targets_s": total - stats.open_s - stats.read_s - stats.check_s,
                         "rank_s": total}
        return out


# ------------------------------------------------------------------------------ the driver
class NodeMemory:
    """The node's peak used memory (``MemTotal - MemAvailable``) above its level at start, sampled
    every 20 ms: what the step added on the node, storage processes and Ray's object store included."""

    def __init__(self) -> None:
        self.base = self._used()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def _used() -> int:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info["MemTotal"] - info["MemAvailable"]

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._used())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak - self.base


def run_arm(arm: str, w: dict, lens: np.ndarray, shm: str) -> dict:
    import ray

    if arm == "tq":
        import transfer_queue as tq

        tq.init()          # in the controller, as verl's trainer does: its actors and storage units live with it
    RolloutActor = ray.remote(num_cpus=0)(Rollout)   # placement is not what is measured: TQ's actors take slots too
    RankActor = ray.remote(num_cpus=0)(Rank)
    coords = rank_coords(w)
    w = dict(w, arm=arm)
    rollout = RolloutActor.remote(w)
    route_bytes = ray.get(rollout.ready.remote())
    ranks = [RankActor.remote(w, c) for c in coords]
    ray.get([r.pid.remote() for r in ranks])
    mem = NodeMemory()
    out: dict = {"arm": arm, "route_bytes": route_bytes}
    t0 = time.time()
    if arm == "tq":
        out["put_s"] = ray.get(rollout.tq_put.remote())
        out["controller_bytes"] = 0                       # the keys only: the storage units hold the bytes
        out["storage_bytes_in"] = route_bytes
        results = ray.get([r.via_tq.remote(len(lens)) for r in ranks])
        out["storage_bytes_out"] = sum(x["bytes_received"] for x in results)
    elif arm == "controller":
        items = ray.get(rollout.arrays.remote())         # the generator output in the controller's process
        out["controller_bytes"] = int(sum(a.nbytes for a in items))
        ref = ray.put(items)                              # the replica's batch, put once
        results = ray.get([r.via_ref.remote([ref]) for r in ranks])
        del items, ref
    else:
        backend = arm.split("-", 1)[1]
        root = os.path.join(shm, "handles")
        got = ray.get(rollout.write_handles.remote(backend, root))
        out["handles_at_controller_s"] = time.time() - got["written_at"]     # the handles' trip, first leg
        out["controller_bytes"] = len(pickle.dumps(got["handles"]))   # a reference pickles to its id
        out["write_s"], out["write_phases"] = got["write_s"], got["write_phases"]
        results = ray.get([r.via_handles.remote(got, backend, root) for r in ranks])
    out["step_s"] = max(x["done_at"] for x in results) - t0
    out["node_added"] = mem.stop()
    out["ranks"] = [{k: v for k, v in x.items() if k != "done_at"} for x in results]
    for r in ranks:
        ray.kill(r)
    ray.kill(rollout)
    if arm == "tq":
        tq.kv_clear(keys=[f"s{i}" for i in range(len(lens))], partition_id="train")
    return out


def write_only(w: dict, store_dir, repeats: int) -> dict:
    """The handles-files write alone: each repeat one fresh ``RouteStore`` writes the step's samples
    (the engine's ``[tokens - 1, L, K]`` arrays, its MoE layers: a strided view) with ``put_many``."""
    from r3bridge.handles import FileRoutes, RouteStore, SampleRoutes

    wd = dict(w, dtype=np.dtype(w["dtype"]))
    lens = lengths_of(w["dist"], w["n"], w["max_len"], w["seed"])
    items = [np.ascontiguousarray(a) for a in engine_output(lens, wd)]
    lay = layout_of(wd)
    routes = [a[:, w["dense"]:] for a in items]
    root = tempfile.mkdtemp(prefix="r3bridge-p6w-", dir=store_dir)
    runs = []
    try:
        for i in range(repeats):
            store = RouteStore(FileRoutes(root), block_rows=w["block_rows"], workers=w["write_threads"])
            entries = [SampleRoutes(f"traj-{j}", r, lay.moe_layer_ids, 0, w["experts"]) for j, r in enumerate(routes)]
            t0 = time.perf_counter()
            store.put_many(entries, step=i)
            runs.append({"write_s": time.perf_counter() - t0, **store.times.as_dict()})
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"workload": w, "tokens": int(lens.sum()), "bytes": int(sum(r.nbytes for r in routes)),
            "cpus": os.cpu_count(), "runs": runs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--ranks", type=int, default=8, help="how many of the replica's TP x CP x PP ranks run")
    ap.add_argument("--write-threads", type=int, default=os.cpu_count() or 1,
                    help="the handles writer's threads (RouteStore workers; default: this host's CPUs)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--write-only", action="store_true", help="time the handles-files write alone (no Ray)")
    ap.add_argument("--repeats", type=int, default=3, help="--write-only: how many writes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    a = ap.parse_args(argv)
    w = dict(layers=a.layers, dense=a.dense, topk=a.topk, experts=a.experts, dtype=a.dtype, tp=a.tp, cp=a.cp, pp=a.pp,
             ep=1, seed=a.seed, mb_tokens=a.mb_tokens, n=a.trajectories, max_len=a.max_tokens, dist=a.dist,
             block_rows=a.block_rows, ranks=min(a.ranks, a.tp * a.cp * a.pp), write_threads=a.write_threads)
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        ap.error(f"unknown arms {bad}; choose from {ARMS}")
    if a.write_only:
        out = write_only(w, a.store_dir, a.repeats)
        if a.out:
            Path(a.out).write_text(json.dumps(out))
        gib = out["bytes"] / 2 ** 30
        print(json.dumps(out) if a.json else "\n".join(
            [f"write only: {w['n']} trajectories <= {w['max_len']} tokens, {gib:.3f} GiB, {w['write_threads']} threads, "
             f"{out['cpus']} CPUs"] +
            [f"  write {r['write_s']:.3f} s ({gib / r['write_s']:.2f} GiB/s); summed over threads: copy "
             f"{r['copy_s']:.3f}, digest {r['digest_s']:.3f}, store {r['store_s']:.3f} s" for r in out["runs"]]))
        return out
    import ray

    import r3bridge.handles  # noqa: F401  (the controller unpickles handles: its import is set-up, not the step's)

    ray.init(num_cpus=max(os.cpu_count() or 2, w["ranks"] + 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{HERE}:{REPO}", "OMP_NUM_THREADS": "1"}})
    lens = lengths_of(w["dist"], w["n"], w["max_len"], w["seed"])
    shm = tempfile.mkdtemp(prefix="r3bridge-p6t-", dir=a.store_dir)
    coords = rank_coords(w)
    out = {"workload": w, "tokens": int(lens.sum()), "cpus": os.cpu_count(), "arms": {}}
    try:
        for arm in arms:
            out["arms"][arm] = run_arm(arm, w, lens, shm)
            shutil.rmtree(os.path.join(shm, "handles"), ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        ray.shutdown()
    shares = [share_bytes(w, lens, c) for c in coords]
    ref = None
    for r in out["arms"].values():
        r["x_share"] = [x["bytes_received"] / s for x, s in zip(r["ranks"], shares)]
        digests = [x["digests"] for x in r["ranks"]]
        r["same_targets"] = ref is None or digests == ref
        ref = ref if ref is not None else digests
    if a.out:
        Path(a.out).write_text(json.dumps(out))
    if a.json:
        print(json.dumps(out))
    else:
        print(markdown(out))
    return out


def markdown(out: dict) -> str:
    w, gib = out["workload"], 2 ** 30
    lines = [f"{w['n']} trajectories <= {w['max_len']} tokens ({out['tokens']:,} tokens), {w['layers']} layers top-{w['topk']} "
             f"{w['dtype']}, {w['ranks']} ranks of TP{w['tp']} x CP{w['cp']} x PP{w['pp']}, {out['cpus']} CPUs", "",
             "| arm | step s | GiB to each rank (max) | x share (max) | GiB via controller | node peak added GiB | "
             "rank added RSS GiB (max) | same targets |", "|---|---|---|---|---|---|---|---|"]
    for arm, r in out["arms"].items():
        lines.append(f"| {arm} | {r['step_s']:.2f} | {max(x['bytes_received'] for x in r['ranks']) / gib:.3f} | "
                     f"{max(r['x_share']):.2f} | {r['controller_bytes'] / gib:.4f} | {r['node_added'] / gib:.2f} | "
                     f"{max(x['added_rss'] for x in r['ranks']) / gib:.3f} | {r['same_targets']} |")
    arms = out["arms"]
    for peer in ("tq", "controller"):
        for mine in ("handles-files", "handles-ray"):
            if peer in arms and mine in arms:
                lines.append(f"\n{peer} / {mine}: time {arms[peer]['step_s'] / arms[mine]['step_s']:.2f}x")
    for arm, r in arms.items():
        if "write_s" in r:
            ph = [x["phases"] for x in r["ranks"]]
            slow = max(ph, key=lambda p: p["trip_s"] + p["rank_s"])
            wp = r["write_phases"]
            lines.append(f"\n{arm} phases: write {r['write_s']:.3f} s wall (over {w['write_threads']} threads: copy "
                         f"{wp['copy_s']:.3f}, digest {wp['digest_s']:.3f}, store {wp['store_s']:.3f} s summed); slowest "
                         f"rank: trip {slow['trip_s']:.3f}, open {slow['open_s']:.3f}, read {slow['read_s']:.3f}, check "
                         f"{slow['check_s']:.3f}, targets {slow['targets_s']:.3f} (rank {slow['rank_s']:.3f}) s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
