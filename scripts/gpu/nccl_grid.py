#!/usr/bin/env python3
"""The whole NCCL grid for one or more megatron-core releases, two- and four-rank cells, in minutes.

    python scripts/gpu/nccl_grid.py --out $OUT [--release 0.16.1=] [--release 0.19.2=/tmp/site-mcore19]
                                    [--spec te] [--gpus N] [--lanes-per-gpu 2] [--cell-timeout 150]
                                    [--deadline 420] [--cells a,b,...] [--device cuda|cpu]

Every cell of ``scripts/gpu/nccl_conformance.py`` (the CPU grid, ``gpu_cells`` and the two FAILFAST
cells) runs at its own world size: two-rank cells on 2 GPUs, four-rank cells on 4 (recorded as
"needs 4 GPUs" on a 2-GPU machine). Each cell still gets fresh processes (fail fast, never hang);
what makes the grid fit a few minutes is running cells side by side in *lanes*: each lane is one
``nccl_conformance.py`` process with its own ``CUDA_VISIBLE_DEVICES`` (a GPU pair for two-rank
cells, all four GPUs for four-rank cells) and its share of the cells, and ``--lanes-per-gpu`` lanes
share each GPU set (the models are tiny: the time is process start, imports and NCCL set-up, not GPU
work; two communicators of different processes on one GPU are independent). Releases run at the
same time too, each with its own ``PYTHONPATH`` prefix (``--release NAME=SITE``: SITE first on the
path, empty for the interpreter's megatron-core; bundle.sh installs 0.16.1 into the interpreter and
0.19.2 into /tmp/site-mcore19, as scripts/version_matrix.py switches releases).

Every cell also runs the gradient check (tests/megatron/replay_grid.py, step 4: every parameter's
gradient, the losses and the aux-loss terms of R2's replay vs the native step, and of R3's replay vs
the same routes forced without r3bridge), reported per cell as "bit-equal", or as the largest
difference bounded by the native step's own run-to-run spread where a kernel is not reproducible
(nccl_conformance.gradient_verdict), or FAIL; ``ep2_alltoall`` adds the broken-backward step (mori
#675), which must be "caught". The two- and four-GPU runs of issue 48 (not run yet: only one-GPU
machines were lent; results go to docs/gpu-results/, see its README):

    python scripts/gpu/nccl_grid.py --spec te --release 0.16.1= --release 0.19.2=/tmp/site-mcore19 --out $OUT/grid

on a 2-GPU machine (two-rank cells) and again on a 4-GPU machine (adds the four-rank cells).

Writes ``<out>/nccl_grid.json`` (per release: the megatron-core version the lanes really imported,
and per cell nccl_conformance's summary: pass, R3 / R2 rows checked and mismatching, R2 logits,
the gradient check, seconds, or the failing rank and its traceback, or why it was skipped), ``<out>/nccl_grid.md`` (the
table for docs/gpu.md) and each lane's log and JSON under ``<out>/lanes/``. Lanes still running at
``--deadline`` seconds are killed (their cells are reported as not finished). Exit status 0 iff every
cell that ran passed.

``--device cpu`` runs the same lanes on gloo (tests/megatron/test_gpu_script.py).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "megatron"))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

# rough seconds per cell on a GPU (process start included), to balance the lanes
COST = {"pp2_1f1b": 45.0}
DEFAULT_COST = 18.0


def grid_cells(names: list[str] | None) -> dict[int, list[str]]:
    """{world size: cell names}: every grid cell (default_cells + gpu_cells) and the FAILFAST cells."""
    from nccl_conformance import FAILFAST
    from replay_grid import cell_world_size, default_cells, gpu_cells

    cells = {c.name: c for c in default_cells() + gpu_cells()}
    worlds = {n: cell_world_size(c) for n, c in cells.items()}
    worlds.update({n: worlds[base] for n, (base, _) in FAILFAST.items()})
    chosen = names or list(worlds)
    unknown = [n for n in chosen if n not in worlds]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; known: {sorted(worlds)}")
    out: dict[int, list[str]] = {}
    for n in chosen:
        out.setdefault(worlds[n], []).append(n)
    return out


def split_lanes(cells: list[str], lanes: int) -> list[list[str]]:
    """Greedy longest-first: each cell to the lane with the least estimated time."""
    load = [0.0] * lanes
    out: list[list[str]] = [[] for _ in range(lanes)]
    for c in sorted(cells, key=lambda n: -COST.get(n, DEFAULT_COST)):
        i = load.index(min(load))
        out[i].append(c)
        load[i] += COST.get(c, DEFAULT_COST)
    return [lane for lane in out if lane]


def plan(args: argparse.Namespace, gpus: int) -> list[dict[str, Any]]:
    """The lanes of every release: {release, site, world, devices, cells, name}."""
    by_world = grid_cells(args.cells.split(",") if args.cells else None)
    lanes = []
    for release, site in args.release:
        for world, cells in sorted(by_world.items()):
            if args.device == "cuda" and world > gpus:
                lanes.append({"release": release, "site": site, "world": world, "devices": None, "cells": cells,
                              "skipped": f"needs {world} GPUs, {gpus} available"})
                continue
            if args.device == "cuda":
                sets = [",".join(str(d) for d in range(i, i + world)) for i in range(0, gpus - world + 1, world)]
            else:
                sets = [None]
            n = max(1, len(sets) * args.lanes_per_gpu)
            for i, part in enumerate(split_lanes(cells, n)):
                lanes.append({"release": release, "site": site, "world": world, "devices": sets[i % len(sets)],
                              "cells": part, "name": f"{release}_w{world}_l{i}"})
    return lanes


def start(lane: dict[str, Any], args: argparse.Namespace, lane_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (lane["site"], str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if lane["devices"] is not None:
        env["CUDA_VISIBLE_DEVICES"] = lane["devices"]
    lane["json"] = str(lane_dir / f"{lane['name']}.json")
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu" / "nccl_conformance.py"), "--device", args.device,
           "--gpus", str(lane["world"]), "--cells", ",".join(lane["cells"]), "--cell-timeout", str(args.cell_timeout),
           "--json", lane["json"]]
    if args.spec != "local":
        cmd += ["--spec", args.spec]
    log = open(lane_dir / f"{lane['name']}.log", "w")
    # its own session: at the deadline the lane and every rank it spawned are killed together
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    gpus = args.gpus if args.gpus is not None else _gpu_count(args.device)
    out = Path(args.out)
    lane_dir = out / "lanes"
    lane_dir.mkdir(parents=True, exist_ok=True)
    lanes = plan(args, gpus)
    t0 = time.time()
    procs = {lane["name"]: start(lane, args, lane_dir) for lane in lanes if "skipped" not in lane}
    print(f"nccl_grid: {len(procs)} lanes on {gpus} GPU(s) ({args.device}), releases "
          f"{[r for r, _ in args.release]}", flush=True)
    while any(p.poll() is None for p in procs.values()) and time.time() - t0 < args.deadline:
        time.sleep(1.0)
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    wall = round(time.time() - t0, 1)
    res: dict[str, Any] = {"gpus": gpus, "device": args.device, "spec": args.spec, "wall_s": wall, "releases": {}}
    for lane in lanes:
        rel = res["releases"].setdefault(lane["release"], {"site": lane["site"] or "(interpreter)", "cells": {},
                                                           "lanes": []})
        if "skipped" in lane:
            for c in lane["cells"]:
                rel["cells"][c] = {"pass": None, "skipped": lane["skipped"], "ranks": lane["world"]}
            continue
        rel["lanes"].append({"name": lane["name"], "devices": lane["devices"], "cells": lane["cells"],
                             "rc": procs[lane["name"]].returncode})
        got = json.loads(Path(lane["json"]).read_text()) if Path(lane["json"]).exists() else None
        for c in lane["cells"]:
            cell = (got or {}).get("cells", {}).get(c)
            if cell is None:
                cell = {"pass": False, "error": f"not finished: lane {lane['name']} ended (rc "
                                                f"{procs[lane['name']].returncode}) or was killed at the "
                                                f"{args.deadline:.0f} s deadline; see lanes/{lane['name']}.log"}
            rel["cells"][c] = {**cell, "ranks": lane["world"]}
        if got:
            for k in ("megatron_core", "transformer_engine", "torch", "nccl", "device"):
                rel.setdefault(k, got.get(k))
    res["all_pass"] = all(c["pass"] is not False for r in res["releases"].values() for c in r["cells"].values())
    return res


def markdown(res: dict[str, Any]) -> str:
    rels = list(res["releases"])
    head = ", ".join(f"{r}: megatron-core {res['releases'][r].get('megatron_core')}" for r in rels)
    lines = [f"{res['gpus']} GPU(s), spec {res['spec']}, {head}; wall {res['wall_s']} s", "",
             "| cell | ranks | " + " | ".join(f"{r}: R3 rows / mismatching | {r}: R2 rows / mismatching | "
                                            f"{r}: gradients R2 vs native / R3 vs forced | {r}: result"
                                            for r in rels) + " |",
             "|---|---|" + "---|---|---|---|" * len(rels)]
    cells = list(dict.fromkeys(c for r in rels for c in res["releases"][r]["cells"]))
    for c in cells:
        row = [c, str(res["releases"][rels[0]]["cells"].get(c, {}).get("ranks", ""))]
        for r in rels:
            x = res["releases"][r]["cells"].get(c, {})
            r3 = f"{x['r3_rows_checked']} / {x['r3_mismatching_rows']}" if "r3_rows_checked" in x else "-"
            r2 = f"{x['r2_rows_checked']} / {x['r2_mismatching_rows']}" if "r2_rows_checked" in x else "-"
            if x.get("pass") is None:
                verdict = x.get("skipped", "-")
            elif "expected_failure" in x:
                verdict = (f"{'pass' if x['pass'] else 'FAIL'}: rank {x.get('failed_rank')} failed on purpose, all ranks "
                           f"ended {x.get('all_ranks_ended_s_after_fault')} s later")
            elif x["pass"]:
                verdict = f"pass ({x.get('seconds')} s)"
            else:
                verdict = "FAIL: " + str(x.get("error", ""))[-160:].replace("\n", " ").replace("|", "/")
            grads = f"{x['r2_vs_native']} / {x['r3_vs_forced']}" if "r2_vs_native" in x else "-"
            if "broken_backward" in x:
                grads += f"; broken backward {x['broken_backward']}"
            row += [r3, r2, grads, verdict]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _gpu_count(device: str) -> int:
    if device != "cuda":
        return 4
    import torch

    return torch.cuda.device_count()


def _release(text: str) -> tuple[str, str]:
    name, _, site = text.partition("=")
    return name, site


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "nccl_grid_out"))
    p.add_argument("--release", type=_release, action="append", default=None,
                   help="NAME=SITE (SITE first on PYTHONPATH; empty: the interpreter's megatron-core); repeatable")
    p.add_argument("--spec", choices=["local", "te"], default="te")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", type=int, default=None, help="default: all GPUs (cpu: 4 ranks)")
    p.add_argument("--lanes-per-gpu", type=int, default=2, help="lanes sharing each GPU set")
    p.add_argument("--cell-timeout", type=float, default=150.0)
    p.add_argument("--deadline", type=float, default=420.0, help="seconds; lanes still running are killed")
    p.add_argument("--cells", default=None, help="comma-separated subset (default: every grid and FAILFAST cell)")
    a = p.parse_args(argv)
    a.release = a.release or [("installed", "")]
    res = run(a)
    out = Path(a.out)
    (out / "nccl_grid.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "nccl_grid.md").write_text(md)
    print(md, flush=True)
    return 0 if res["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
