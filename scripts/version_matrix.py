"""Support table: megatron-core release x (CPU test suite, NCCL grid cell), for the device machine.

    bash scripts/version_matrix_wheels.sh                 # here: .whl/megatron/*, .whl/common/*
    python3 scripts/version_matrix.py --out $OUT          # there (Python 3.12), carrying .whl

For each megatron-core wheel in ``.whl/megatron`` (each installed into its own ``--target``, next to
``.whl/common``: omegaconf + antlr4 for tests/core/test_config.py):

a. the CPU test suite (``tests/core tests/megatron tests/cli``) with CUDA hidden
   (``CUDA_VISIBLE_DEVICES=``), all releases at once, one pytest process each, each under
   ``--suite-timeout``; ``tests/adapters`` is not collected: verl / SkyRL / AReaL cannot be
   installed on that image (no registry; SkyRL 0.3 / AReaL 1.0 pin other torch versions);
b. the NCCL grid (``scripts/gpu/nccl_conformance.py --cells all``) per release, one after the
   other, when the machine has >= 2 GPUs; otherwise each cell is recorded as "not run: N GPU".

Writes ``version_matrix.json`` and ``version_matrix.md`` (the table for docs/support-matrix.md)
plus every pytest log / junit xml / grid json into ``--out``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["tests/core", "tests/megatron", "tests/cli"]
# the grid (test_replay_conformance) runs every cell in one module-scoped fixture: a per-test limit
# must leave room for that whole setup (it took > 240 s on 16 CPU cores for 4 releases at once)
TEST_TIMEOUT_S = 900
GRID_TEST = "tests/megatron/test_replay_conformance.py"


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def install(wheels: Path, site: Path) -> dict[str, Path]:
    """{version: site dir}; the common wheels go to site/common."""
    common = site / "common"
    common_whl = sorted(glob.glob(str(wheels / "common" / "*.whl")))
    if common_whl:
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--target", str(common), *common_whl])
    out = {}
    for whl in sorted(glob.glob(str(wheels / "megatron" / "megatron_core-*.whl"))):
        version = Path(whl).name.split("-")[1]
        target = site / f"mc-{version}"
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--target", str(target), whl])
        out[version] = target
    if not out:
        raise SystemExit(f"no megatron_core wheels under {wheels / 'megatron'} (run scripts/version_matrix_wheels.sh)")
    return out


def env_for(site: Path, common: Path, hide_cuda: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(common), str(ROOT)]),
               PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               # Tiny models: one intra-op thread per process. Several suites run at once, each
               # spawning 2-4 ranks; torch's default (one thread per core) oversubscribes the host.
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def parse_junit(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"collected": 0, "outcomes": {}}
    root = ET.parse(path).getroot()
    outcomes: dict[str, dict[str, str]] = {}
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        status, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = (el.get("message") or el.text or "").strip().splitlines()[0][:300] if (el.get("message") or el.text) else ""
                break
        outcomes[name] = {"status": status, "why": why}
    return {"collected": len(outcomes), "outcomes": outcomes}


def parse_verbose_log(path: Path) -> dict[str, Any]:
    """Outcomes from ``pytest -v`` lines (``path::test PASSED``), for a suite cut off by its timeout."""
    outcomes: dict[str, dict[str, str]] = {}
    if path.exists():
        for m in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", path.read_text(), flags=re.M):
            outcomes[m.group(1)] = {"status": {"PASSED": "passed", "FAILED": "failed", "ERROR": "error",
                                               "SKIPPED": "skipped"}[m.group(2)], "why": ""}
    return {"collected": len(outcomes), "outcomes": outcomes}


def run_suites(sites: dict[str, Path], common: Path, out: Path, timeout: int) -> dict[str, Any]:
    procs = {}
    for v, site in sites.items():
        log = open(out / f"cpu-{v}.log", "w")
        # A per-test timeout (pytest-timeout, on the device image) so one stuck test is reported
        # as a failure and the junit file is still written, instead of the whole suite timing out.
        cmd = ["timeout", "-k", "10", str(timeout), sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short",
               "-p", "no:cacheprovider", "-p", "timeout", f"--timeout={TEST_TIMEOUT_S}",
               *SUITE, f"--junitxml={out / f'cpu-{v}.xml'}"]
        procs[v] = (subprocess.Popen(cmd, cwd=ROOT, env=env_for(site, common, hide_cuda=True), stdout=log,
                                     stderr=subprocess.STDOUT), log, time.time())
    res = {}
    for v, (p, log, t0) in procs.items():
        rc = p.wait()
        log.close()
        j = parse_junit(out / f"cpu-{v}.xml")
        if not j["outcomes"]:       # suite killed before pytest wrote junit: read the -v log
            j = parse_verbose_log(out / f"cpu-{v}.log")
        counts: dict[str, int] = {}
        for o in j["outcomes"].values():
            counts[o["status"]] = counts.get(o["status"], 0) + 1
        tail = (out / f"cpu-{v}.log").read_text()[-2000:]
        res[v] = {"rc": rc, "timed_out": rc in (124, 137), "seconds": round(time.time() - t0, 1),
                  "counts": counts, "outcomes": j["outcomes"], "log_tail": tail}
    return res


def cpu_grid_cells(outcomes: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Per CPU grid cell: pass if its parametrized tests in test_replay_conformance all passed."""
    cells: dict[str, list[dict[str, str]]] = {}
    for name, o in outcomes.items():
        m = re.search(r"test_replay_conformance.*\[(.+)\]$", name)
        if m:
            cells.setdefault(m.group(1), []).append(o)
    out = {}
    for cell, os_ in cells.items():
        bad = [o for o in os_ if o["status"] != "passed"]
        out[cell] = {"result": "pass" if not bad else bad[0]["status"], "why": bad[0]["why"] if bad else ""}
    return out


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no driver: no GPUs
        return 0


def run_grids(sites: dict[str, Path], common: Path, out: Path, gpus: int, timeout: int) -> dict[str, Any]:
    res = {}
    for v, site in sites.items():
        if gpus < 2:
            res[v] = {"not_run": f"not run: {gpus} GPU"}
            continue
        js = out / f"nccl-{v}.json"
        cmd = ["timeout", "-k", "10", str(timeout), sys.executable, "scripts/gpu/nccl_conformance.py",
               "--gpus", str(gpus), "--cells", "all", "--json", str(js)]
        with open(out / f"nccl-{v}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env_for(site, common, hide_cuda=False), stdout=log,
                                stderr=subprocess.STDOUT).returncode
        res[v] = json.loads(js.read_text()) if js.exists() else {"not_run": f"script failed rc={rc}, see nccl-{v}.log"}
    return res


def markdown(suites: dict[str, Any], grids: dict[str, Any], gpus: int, py: str, torch_v: str) -> str:
    versions = list(suites)
    lines = [f"Python {py}, torch {torch_v}, {gpus} GPU(s). CPU suite = `{' '.join(SUITE)}` with CUDA hidden.", "",
             "| megatron-core | CPU suite | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|---|"]
    for v in versions:
        s = suites[v]
        c = s["counts"]
        verdict = "timeout" if s["timed_out"] else ("pass" if s["rc"] == 0 else "FAIL")
        lines.append(f"| {v} | {verdict} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('error', 0)} | "
                     f"{c.get('skipped', 0)} | {s['seconds']} |")
    cells = sorted({c for v in versions for c in cpu_grid_cells(suites[v]["outcomes"])} |
                   {c for v in versions for c in grids.get(v, {}).get("cells", {})})
    lines += ["", "Grid cells (CPU = gloo grid in the suite; NCCL = scripts/gpu/nccl_conformance.py, bf16):", "",
              "| cell | " + " | ".join(f"{v} CPU | {v} NCCL" for v in versions) + " |",
              "|---|" + "---|---|" * len(versions)]
    for cell in cells:
        row = [cell]
        for v in versions:
            cpu = cpu_grid_cells(suites[v]["outcomes"]).get(cell)
            row.append("-" if cpu is None else (cpu["result"] + (f": {cpu['why'][:80]}" if cpu["why"] else "")))
            g = grids.get(v, {})
            if "not_run" in g:
                row.append(g["not_run"])
            else:
                r = g.get("cells", {}).get(cell)
                if r is None:
                    row.append("-")
                elif r.get("pass") is None:
                    row.append(r.get("skipped", "skipped"))
                else:
                    row.append("pass" if r["pass"] else "FAIL: " + str(r.get("error", ""))[-120:].replace("\n", " ")
                               .replace("|", "/"))
        lines.append("| " + " | ".join(row) + " |")
    fails = [(v, n, o) for v in versions for n, o in suites[v]["outcomes"].items() if o["status"] in ("failed", "error")]
    if fails:
        lines += ["", "Failed tests:", ""] + [f"- {v} `{n}`: {o['why'][:200]}" for v, n, o in fails]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--wheels", default=str(ROOT / ".whl"))
    p.add_argument("--site", default="/tmp/vm")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "out")))
    p.add_argument("--versions", default=None, help="comma-separated subset of the carried releases")
    p.add_argument("--suite", default=",".join(SUITE), help="comma-separated test paths (default: the CPU suite)")
    p.add_argument("--suite-timeout", type=int, default=480)
    p.add_argument("--grid-timeout", type=int, default=900)
    a = p.parse_args()
    SUITE[:] = a.suite.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # r3bridge.adapters maps to ./adapters in an install (pyproject package-dir); a bare checkout
    # needs the link the worktrees have
    link = ROOT / "r3bridge" / "adapters"
    if not link.exists():
        link.symlink_to("../adapters")
    sites = install(Path(a.wheels), Path(a.site))
    if a.versions:
        keep = a.versions.split(",")
        sites = {v: s for v, s in sites.items() if v in keep}
    common = Path(a.site) / "common"
    gpus = gpu_count()
    print(f"releases {list(sites)}, {gpus} GPU(s)", flush=True)
    suites = run_suites(sites, common, out, a.suite_timeout)
    grids = run_grids(sites, common, out, gpus, a.grid_timeout)
    import torch

    py = ".".join(map(str, sys.version_info[:3]))
    md = markdown(suites, grids, gpus, py, torch.__version__)
    (out / "version_matrix.md").write_text(md)
    (out / "version_matrix.json").write_text(json.dumps(
        {"python": py, "torch": torch.__version__, "gpus": gpus,
         "suites": {v: {k: s[k] for k in ("rc", "timed_out", "seconds", "counts")} |
                    {"failed": {n: o for n, o in s["outcomes"].items() if o["status"] in ("failed", "error")}}
                    for v, s in suites.items()},
         "grids": grids}, indent=1))
    print(md)
    return 0 if all(s["rc"] == 0 for s in suites.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
