"""`r3bridge evidence run` / `plot`: the GRPO evidence loop run for real at a tiny size (HF
transformers engine, megatron-core trainer, CPU), and its logs read back by the plot command."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

from r3bridge.cli._common import jsonable
from r3bridge.demo import evidence_report

KEYS = {"critic/score/mean", "task/accuracy", "actor/entropy", "route/native_vs_engine",
        "actor/r3bridge/old_log_prob/mismatch/k3_kl", "actor/r3bridge/old_log_prob/mismatch/F2",
        "actor/r3bridge/update/mismatch/k3_kl", "actor/grad_norm/p50", "actor/grad_norm/p99",
        "actor/first_update/abs_log_ratio", "timing_s/step"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "r3bridge", "evidence", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evidence_run_three_arms_and_floor_then_plot(tmp_path):
    out = tmp_path / "run"
    proc = _cli("run", "--out", str(out), "--engine", "hf", "--device", "cpu", "--steps", "2", "--prompts", "4",
                "--group", "2", "--seeds", "0", "--layers", "2", "--sft-steps", "2", "--sft-batch", "16",
                "--wall-s", "500", "--json")
    summary = json.loads(proc.stdout)
    assert summary == {n: {"status": "done", "steps": 2} for n in ("off-s0", "R2-s0", "R3-s0", "floor-s0")}
    logs = {n: _steps(out / "logs" / f"{n}.jsonl") for n in summary}
    for name, lines in logs.items():
        assert [line["step"] for line in lines] == [0, 1], name          # verl's file-logger lines
        assert KEYS <= set(lines[0]["data"]), (name, KEYS - set(lines[0]["data"]))
    # the same warm start and seed: the three arms sample the same first step
    first = {n: logs[n][0]["data"] for n in ("off-s0", "R2-s0", "R3-s0")}
    assert len({(d["critic/score/mean"], d["response_length/mean"]) for d in first.values()}) == 1
    # replay runs on every row that has a route (each sequence's last token has none)
    r3 = logs["R3-s0"][0]["data"]
    assert 0.8 < r3["actor/r3bridge/update/coverage"] < 1.0 and r3["actor/r3bridge/old_log_prob/coverage"] > 0.8
    assert "actor/r3bridge/update/coverage" not in first["off-s0"]
    # the noise floor: the engine is the trainer's own forward, so under R3 compute_log_prob repeats
    # it exactly on the CPU: not a rounding error, no router flip
    for line in logs["floor-s0"]:
        assert line["data"]["actor/r3bridge/old_log_prob/mismatch/k3_kl"] == 0.0
        assert line["data"]["route/native_vs_engine"] == 1.0
    meta = json.loads((out / "logs" / "R2-s0.json").read_text())
    assert meta["status"] == "done" and meta["arm"] == {"name": "R2-s0", "mode": "R2", "seed": 0, "engine": "hf"}

    # the figure and the table from the logs, and the same summary from the compressed logs
    png = tmp_path / "evidence.png"
    plotted = json.loads(_cli("plot", str(out), "--out", str(png), "--warmup", "0", "--json").stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(plotted["groups"]) == {"off", "R2", "R3", "floor"}
    assert set(plotted["ratios"]) == {"off/R3", "off/R2"}
    # the committed form: gzipped logs read back to the same summary (in this process: one CLI
    # start less), and its table
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in summary:
        (packed / f"{name}.jsonl.gz").write_bytes(gzip.compress((out / "logs" / f"{name}.jsonl").read_bytes()))
    again = evidence_report.summarize(evidence_report.load_logs(packed), 0)
    plotted.pop("plot")
    assert json.loads(json.dumps(jsonable(again))) == plotted
    assert "off/R3 (every seed?)" in evidence_report.table(again)


def test_evidence_refuses_what_cannot_run_before_starting(tmp_path, monkeypatch, capsys):
    from r3bridge.cli import evidence as evidence_cmd
    from r3bridge.cli.main import main

    monkeypatch.setattr(evidence_cmd, "installed", lambda module: module != "vllm")
    cases = [(["--device", "cpu"], "--engine vllm needs vLLM importable"),
             (["--engine", "hf", "--device", "cpu", "--spec", "te"], "--spec te needs --device cuda"),
             (["--engine", "hf", "--device", "cpu", "--prompts", "3", "--group", "3"], "must split into 4 mini-batches")]
    for args, message in cases:
        assert main(["evidence", "run", "--out", str(tmp_path / "run"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run").exists()                 # refused before anything was written
    assert main(["evidence", "plot", str(tmp_path)]) == 2
    assert "no <arm>.jsonl" in capsys.readouterr().err
