"""`r3bridge evidence run` / `plot`: the GRPO evidence loop run for real at a tiny size (HF
transformers engine, megatron-core trainer, CPU): a calibration of two candidate models, the
chosen one's arms (a mini-batch count in an arm's name), a second run from the first one's warm
start (as a later device session would), and both runs' logs read back into one table."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys

import pytest

from r3bridge.cli._common import jsonable
from r3bridge.demo import evidence, evidence_config, evidence_report

KEYS = {"critic/score/mean", "task/accuracy", "actor/entropy", "route/native_vs_engine",
        "actor/r3bridge/old_log_prob/mismatch/k3_kl", "actor/r3bridge/old_log_prob/mismatch/F2",
        "actor/r3bridge/update/mismatch/k3_kl", "actor/grad_norm/p50", "actor/grad_norm/p99", "actor/grad_norm/max",
        "actor/first_update/abs_log_ratio", "timing_s/step"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "r3bridge", "evidence", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evidence_calibrates_then_runs_the_chosen_model_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    # two candidates side by side (untrained: --sft-target 0); the first to agree at most 0.999
    # runs (the HF engine holds bf16-rounded weights, the fp32 trainer does not: a few routes
    # flip), its warm start reused, every arm on its shape
    candidates = "L2-E8-k2,L3-E16-k4-h64-f32-aux0.05-z0.001"
    proc = _cli("run", "--out", str(out), "--engine", "hf", "--device", "cpu", "--steps", "2", "--prompts", "4",
                "--group", "2", "--sft-steps", "2", "--sft-batch", "16", "--sft-target", "0",
                "--calibrate", candidates, "--calib-steps", "1", "--max-agreement", "0.999",
                "--arms", "off-s0,R2-s0,floor-s0", "--wall-s", "500", "--json")
    calib = json.loads((out / "calibration.json").read_text())
    rows = {r["name"]: r for r in calib["candidates"]}
    assert list(rows) == candidates.split(",") and all(r["ran"] for r in rows.values())
    for r in rows.values():
        assert 0.0 < r["agreement"] <= 1.0 and r["step_s"] > 0 and r["run_s_alone"] == r["step_s"] * 2
        # no arm has more mini-batches than the calibration arm's 4: its step is the slowest; no
        # GPU here, so the cores bound the estimate (x 1.3, --side-by-side-factor's default)
        assert r["slowest_step_s"] == r["step_s"] and r["gpu_utilization"] is None and r["bound_by"] == "cores"
        assert r["run_s_estimate"] == pytest.approx(r["step_s"] * 2 * 1.3)
        assert set(r["agreement_per_layer"]) == {str(i) for i in range(r["shape"]["layers"])}
        assert r["warm_margin_median"] > 0 and 0.0 <= r["margin_below"] <= 1.0 and r["trainer_dtype"] is None
    assert "2 of 2 candidate(s) ready" in proc.stderr and (out / "calib" / "GO").exists()   # stepped together
    want = next((n for n, r in rows.items() if r["agreement"] <= 0.999), None)
    if want is None:                        # none qualifies: the least-agreeing one, said so
        want = min(rows, key=lambda n: rows[n]["agreement"])
        assert not calib["goal_met"] and calib["reason"].startswith("GOAL NOT MET")
    assert calib["chosen"] == want
    # no candidate qualifies (agreement at most 0): the least-agreeing one runs, and it says so
    none = evidence.choose(calib["candidates"], 0.0)
    assert none["chosen"] == min(rows, key=lambda n: rows[n]["agreement"]) and not none["goal_met"]
    assert none["reason"].startswith("GOAL NOT MET")
    run = json.loads((out / "run.json").read_text())
    assert run["shape"] == rows[want]["shape"] and run["warm"]["router_z_loss"] == rows[want]["router_z_loss"]
    assert (out / "warmstart" / "state.pt").read_bytes() == (out / "calib" / want / "warmstart" / "state.pt").read_bytes()

    # the warm start says what it was trained for and which weights; run.json says which it loaded
    spec = json.loads((out / "warmstart" / "spec.json").read_text())
    assert spec["shape"] == run["shape"] and spec["task"] == run["task"]
    assert spec["state_sha256"] == run["warm_start_sha256"] == evidence_config.sha256_of(out / "warmstart" / "state.pt")
    assert run["commit"] == evidence.source_commit()
    import megatron.core
    import transformers
    assert (run["versions"]["megatron-core"], run["versions"]["transformers"]) == (
        megatron.core.__version__, transformers.__version__)
    assert run["versions"]["vllm"] is None and "gpu" not in run["versions"]     # the CPU run: no engine, no GPU

    # a later session: the first run's warm start, one more arm, the same options (model and task
    # taken from the warm start's spec.json)
    out2 = tmp_path / "run2"
    proc2 = _cli("run", "--out", str(out2), "--engine", "hf", "--device", "cpu", "--steps", "2", "--prompts", "4",
                 "--group", "2", "--warm-start", str(out / "warmstart"), "--arms", "R3-mb1-s0", "--wall-s", "300",
                 "--json")
    run2 = json.loads((out2 / "run.json").read_text())
    assert run2["shape"] == run["shape"] and run2["task"] == run["task"] and run2["warm"] == run["warm"]
    assert run2["warm_start_sha256"] == run["warm_start_sha256"]
    assert not (out2 / "calibration.json").exists() and "[warm start]" not in proc2.stderr   # nothing trained

    summary = {**json.loads(proc.stdout), **json.loads(proc2.stdout)}
    assert summary == {n: {"status": "done", "steps": 2} for n in ("off-s0", "R2-s0", "floor-s0", "R3-mb1-s0")}
    folder = {n: out if n != "R3-mb1-s0" else out2 for n in summary}
    logs = {n: _steps(folder[n] / "logs" / f"{n}.jsonl") for n in summary}
    for name, lines in logs.items():
        assert [line["step"] for line in lines] == [0, 1], name          # verl's file-logger lines
        assert KEYS <= set(lines[0]["data"]), (name, KEYS - set(lines[0]["data"]))
    assert {n: logs[n][0]["data"]["actor/mini_batches"] for n in summary} == {
        "off-s0": 4, "R2-s0": 4, "R3-mb1-s0": 1, "floor-s0": 4}
    # native routing at theta_old: the margins of the trainer's own routers and the agreement per layer
    off = logs["off-s0"][0]["data"]
    per_layer = [off[f"route/native_vs_engine/layer{i}"] for i in range(run["shape"]["layers"])]
    assert min(per_layer) <= off["route/native_vs_engine"] <= max(per_layer)
    assert off["route/margin/median"] > 0
    # the same warm start and seed: the arms sample the same first step, in either run
    first = {n: logs[n][0]["data"] for n in ("off-s0", "R2-s0", "R3-mb1-s0")}
    assert len({(d["critic/score/mean"], d["response_length/mean"]) for d in first.values()}) == 1
    # replay runs on every row that has a route (each sequence's last token has none)
    r3 = logs["R3-mb1-s0"][0]["data"]
    assert 0.8 < r3["actor/r3bridge/update/coverage"] < 1.0 and r3["actor/r3bridge/old_log_prob/coverage"] > 0.8
    assert "actor/r3bridge/update/coverage" not in first["off-s0"]
    assert not any(k.startswith("actor/router/") for k in first["off-s0"])    # no router loss by default
    # the noise floor: the engine is the trainer's own forward, so under R3 compute_log_prob repeats
    # it exactly on the CPU: not a rounding error, no router flip
    for line in logs["floor-s0"]:
        assert line["data"]["actor/r3bridge/old_log_prob/mismatch/k3_kl"] == 0.0
        assert line["data"]["route/native_vs_engine"] == 1.0
    meta = json.loads((out / "logs" / "R2-s0.json").read_text())
    assert meta["status"] == "done" and meta["arm"] == {"name": "R2-s0", "mode": "R2", "seed": 0, "engine": "hf",
                                                        "mini_batches": None}

    # the figure and the table from both runs' logs, and the same summary from the compressed logs
    png = tmp_path / "evidence.png"
    plotted = json.loads(_cli("report", str(out), str(out2), "--out", str(png), "--warmup", "0", "--json").stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(plotted["groups"]) == {"off", "R2", "R3-mb1", "floor"}
    assert [(r["folder"], r["warm_start_sha256"], r["commit"], r["arms"]) for r in plotted["runs"]] == [
        (str(out), run["warm_start_sha256"], run["commit"], ["R2-s0", "floor-s0", "off-s0"]),
        (str(out2), run["warm_start_sha256"], run2["commit"], ["R3-mb1-s0"])]
    for g, d in plotted["groups"].items():      # where each step's seconds went, phase by phase
        t = d["timing_s"]
        assert all(t[ph] >= 0 for ph in evidence_report.PHASES) and t["gen"] > 0, (g, t)
        assert t["gen"] + t["old_log_prob"] + t["update_actor"] <= t["step"], (g, t)
    assert set(plotted["ratios"]) == {"off/R2"}
    goals = {g["goal"]: g for g in plotted["goals"]}
    assert goals["off's route agreement <= 0.95"]["met"] == (plotted["groups"]["off"]["metrics"][
        "route/native_vs_engine"]["mean"] <= 0.95)
    assert goals["R3's k3 KL (compute_log_prob) >= 5x below off's"]["met"] is None     # no R3 arm at 4 mini-batches
    # the committed form: gzipped logs read back to the same summary (in this process: one CLI
    # start less), and its table
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in summary:
        (packed / f"{name}.jsonl.gz").write_bytes(gzip.compress((folder[name] / "logs" / f"{name}.jsonl").read_bytes()))
    again = evidence_report.summarize(evidence_report.load_logs(packed), 0)
    plotted.pop("plot")
    plotted.pop("runs")
    assert plotted.pop("calibration") == calib           # the run folder's calibration comes with its table
    assert json.loads(json.dumps(jsonable(again))) == plotted
    text = evidence_report.table(again)
    assert "off/R2 (every seed?)" in text and "R2 against R3 at 1, 4 and 8 mini-batches" in text
    assert "off's route agreement <= 0.95" in text and "not measured" in text
    assert "Where a step's seconds go" in text
    # each arm's largest update gradient norm, and the step it came at, as the logs have it
    for name, arm_log in ((a.name, a) for a in evidence_report.load_logs(packed)):
        value, step = max((d["actor/grad_norm/max"], s) for s, d in zip(arm_log.steps, arm_log.data))
        assert value >= max(d["actor/grad_norm/p99"] for d in arm_log.data)
        assert f"{name} {evidence_report._fmt(value)} ({step})" in text
    assert f"Chosen: `{want}`" in evidence_report.calibration_table(calib)
    _status_of_a_running_run(tmp_path, capsys, out)
    _refusals_of_warm_starts_and_merges(tmp_path, capsys, out, out2, run)


def _status_of_a_running_run(tmp_path, capsys, out):
    """`r3bridge evidence status` on the run above, as if still running: a copy whose run.json asks for
    10 steps (2 done), read at two moments before its wall, with a log line half written."""
    from r3bridge.cli.main import main

    live = tmp_path / "live"
    shutil.copytree(out / "logs", live / "logs")
    doc = json.loads((out / "run.json").read_text())
    doc["grpo"]["steps"] = 10
    (live / "run.json").write_text(json.dumps(doc))
    with open(live / "logs" / "off-s0.jsonl", "a") as f:
        f.write('{"step": 2, "data": {"route/nat')
    logged = {n: _steps(out / "logs" / f"{n}.jsonl") for n in ("R2-s0", "floor-s0", "off-s0")}
    step_s = {n: sum(x["data"]["timing_s/step"] for x in rows) / len(rows) for n, rows in logged.items()}
    slowest = max(step_s.values())
    arms = evidence_report.progress(live, now=doc["deadline"] - 8.5 * slowest)
    assert [a["arm"] for a in arms] == sorted(logged) and all(a["steps"] == 2 for a in arms)
    for a in arms:
        rows = logged[a["arm"]]
        assert a["agreement"] == sum(x["data"]["route/native_vs_engine"] for x in rows) / len(rows)
        assert a["step_s"] == step_s[a["arm"]] and a["steps_by_wall"] >= 10
    assert all(line.endswith(": on pace") for line in evidence_report.progress_lines(arms))
    short = evidence_report.progress(live, now=doc["deadline"] - 3.5 * slowest)
    slow = next(a for a in short if a["step_s"] == slowest)
    assert slow["steps_by_wall"] == 5
    assert main(["evidence", "status", str(live)]) == 0
    printed = capsys.readouterr().out
    assert f"{slow['arm']}: 2 steps, agreement (last 20) " in printed and " s a step: " in printed   # pace: now's


def _refusals_of_warm_starts_and_merges(tmp_path, capsys, out, out2, run):
    """In this process, on the runs above: a warm start for another shape or task, a damaged one,
    and arms of different warm starts or settings merged, each refused naming what differs."""
    from r3bridge.cli.main import main

    def refused(args, message):
        assert main(["evidence", *args]) == 2
        assert message in (err := capsys.readouterr().err), err

    base = ["run", "--out", str(tmp_path / "refused"), "--engine", "hf", "--device", "cpu", "--arms", "off-s0"]
    layers = run["shape"]["layers"]
    refused([*base, "--warm-start", str(out / "warmstart"), "--layers", str(layers + 1)],
            f"shape.layers ({layers + 1} vs {layers})")
    refused([*base, "--warm-start", str(out / "warmstart"), "--max-digits", "5"], "task.max_digits (5 vs 3)")
    refused([*base, "--warm-start", str(out / "warmstart"), "--calibrate"], "--warm-start excludes --calibrate")
    refused([*base, "--warm-start", str(out / "warmstart"), "--sft-steps", "5", "--aux-loss", "0.1"],
            "--sft-steps, --aux-loss: no effect with --warm-start")
    damaged = tmp_path / "damaged"
    shutil.copytree(out / "warmstart", damaged)
    with open(damaged / "state.pt", "ab") as f:
        f.write(b"\0")
    refused([*base, "--warm-start", str(damaged)], "is not spec.json's")
    (damaged / "spec.json").unlink()
    refused([*base, "--warm-start", str(damaged)], "spec.json missing")
    assert not (tmp_path / "refused").exists()
    # merging: another warm start's arms, another setting, the same arm twice
    other = tmp_path / "other"
    shutil.copytree(out2, other, ignore=shutil.ignore_patterns("ckpt", "model", "warmstart"))
    doc = json.loads((other / "run.json").read_text())
    for change, message in ((lambda d: d.update(warm_start_sha256="0" * 64), "warm start 000000000000 is not"),
                            (lambda d: d["grpo"].update(lr=1e-3), "differ in grpo.lr (0.0001 vs 0.001)"),
                            (lambda d: d["grpo"].update(router_losses=0.1),
                             "differ in grpo.router_losses (0.0 vs 0.1)"),
                            (lambda d: d["versions"].update(vllm="0.26.0"),
                             "ran on different software or GPUs: vllm (None vs 0.26.0)")):
        changed = json.loads(json.dumps(doc))
        change(changed)
        (other / "run.json").write_text(json.dumps(changed))
        assert main(["evidence", "report", str(out), str(other), "--out", ""]) == 2
        assert "cannot merge runs" in (err := capsys.readouterr().err) and message in err, err
    # a run from before an option existed (router_losses: 2026-11-29's arms) holds its default
    older = json.loads(json.dumps(doc))
    del older["grpo"]["router_losses"]
    del older["versions"]       # nor did it record its versions: shown as unknown, not compared
    (other / "run.json").write_text(json.dumps(older))
    merged = evidence_report.load_runs([out, other])[1]
    assert len(merged) == 2 and merged[1]["versions"] is None
    shown = evidence_report.runs_table(merged).splitlines()
    assert f"megatron-core {run['versions']['megatron-core']}" in shown[2] and "| unknown |" in shown[3]
    (other / "run.json").write_text(json.dumps(doc))
    with pytest.raises(evidence_config.EvidenceError, match="arm R3-mb1-s0 is in both"):
        evidence_report.load_runs([out2, other])


def test_evidence_refuses_what_cannot_run_before_starting(tmp_path, monkeypatch, capsys):
    from r3bridge.cli import evidence as evidence_cmd
    from r3bridge.cli.main import main

    monkeypatch.setattr(evidence_cmd, "installed", lambda module: module != "vllm")
    cases = [(["--device", "cpu"], "--engine vllm needs vLLM importable"),
             (["--engine", "hf", "--device", "cpu", "--spec", "te"], "--spec te needs --device cuda"),
             (["--engine", "hf", "--device", "cpu", "--prompts", "3", "--group", "3"], "must split into 4 mini-batches"),
             (["--engine", "hf", "--device", "cpu", "--topk", "9"], "topk must be in 1..experts (8), got 9"),
             (["--engine", "hf", "--device", "cpu", "--hidden", "100"], "hidden must be a multiple of 16"),
             (["--engine", "hf", "--device", "cpu", "--calibrate", "L4-E8,L8-x2"], "cannot read 'x2'"),
             (["--engine", "hf", "--device", "cpu", "--calibrate", "L4-E8-k16"], "candidate 'L4-E8-k16': the evidence"),
             (["--engine", "hf", "--device", "cpu", "--arms", "off-s0,R4-s0"], "mode 'R4' is not one of"),
             (["--engine", "hf", "--device", "cpu", "--prompts", "2", "--group", "2", "--mini-batches", "2",
               "--arms", "off-s0,R2-mb8-s0"], "arm R2-mb8-s0: 2 x 2 samples must split into 8")]
    for args, message in cases:
        assert main(["evidence", "run", "--out", str(tmp_path / "run"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run").exists()                 # refused before anything was written
    assert main(["evidence", "plot", str(tmp_path)]) == 2
    assert "no <arm>.jsonl" in capsys.readouterr().err


def test_warm_start_grouped_experts_and_z_loss_as_the_loop_computes_them():
    """The warm start's grouped expert GEMMs (its default: one kernel per layer on a GPU) give the
    Python loop's loss and gradients, z-loss and load-balancing loss included; its margins read
    the k-th minus the (k+1)-th router logit."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from r3bridge.demo.task import AdditionTask
    from r3bridge.demo.warmstart import EvidenceModelShape, _answer_loss, margins_of

    cfg = EvidenceModelShape(layers=2, experts=16, topk=4, hidden=64, moe_ffn=32).hf_config()
    ids, mask = (torch.as_tensor(x) for x in AdditionTask().sft_batch(16, np.random.default_rng(0)))
    out = {}
    for impl in ("eager", "grouped_mm"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation=impl)
        total, loss, *_ = _answer_loss(model, ids, mask, 0.05, 1e-2)
        total.backward()
        out[impl] = (total.item(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        _, plain, *_ = _answer_loss(model, ids, mask, 0.0, 0.0)
        assert total.item() > plain.item() == loss.item()          # the router losses are in the total only
    (t_loop, l_loop, g_loop), (t_grp, l_grp, g_grp) = out["eager"], out["grouped_mm"]
    assert abs(t_loop - t_grp) < 1e-5 and abs(l_loop - l_grp) < 1e-5
    for name, g in g_loop.items():
        torch.testing.assert_close(g_grp[name], g, rtol=1e-4, atol=1e-6, msg=name)
    logits = torch.tensor([[3.0, 2.5, 2.495, 0.0], [1.0, 0.2, 0.9, 0.0]])
    m = margins_of([logits, logits[:1]], [0, 2], topk=2)
    assert [x["layer"] for x in m["per_layer"]] == [0, 2]
    assert m["per_layer"][0]["below"] == 0.5 and abs(m["per_layer"][1]["median"] - 0.005) < 1e-6


def test_calibration_choice_wants_disagreement_accuracy_and_time_in_that_order():
    def row(name, agreement, accuracy, run_s):
        return {"name": name, "ran": True, "agreement": agreement, "accuracy": accuracy, "target_accuracy": 0.6,
                "run_s_estimate": run_s, "error": ""}

    rows = [row("cheap", 0.99, 0.7, 100), row("untrained", 0.93, 0.2, 100), row("mid", 0.97, 0.65, 200),
            row("slow", 0.90, 0.7, 10_000)]
    # the first (cheapest) that qualifies, not the least-agreeing
    assert evidence.choose(rows, 0.98, budget_s=500)["chosen"] == "mid"
    # none qualifies: least-agreeing among those that fit and reached the target accuracy
    # ("untrained" agrees less but its warm start is far from the target, "slow" does not fit)
    none = evidence.choose(rows, 0.95, budget_s=500)
    assert none["chosen"] == "mid" and not none["goal_met"] and none["reason"].startswith("GOAL NOT MET")
    assert evidence.choose(rows, 0.95, budget_s=20_000)["chosen"] == "slow"
    # nothing fits: the fastest, and the reason says the run will be cut short
    short = evidence.choose(rows, 0.95, budget_s=50)
    assert short["chosen"] == "cheap" and "cut short" in short["reason"]
    # the estimate: the longer of the cores' bound and the GPU's (13 arms' shares of a GPU that two
    # candidates side by side kept 40 % busy: 13 x 20 % of the step)
    est = [{"ran": True, "step_s": 1.0, "slowest_step_s": 1.5, "gpu_utilization": 40.0},
           {"ran": True, "step_s": 1.0, "slowest_step_s": 1.0, "gpu_utilization": None}, {"ran": False}]
    evidence._estimate_runs(est, steps=300, arms=13, side_by_side=1.3)
    assert est[0]["bound_by"] == "GPU" and est[0]["run_s_estimate"] == pytest.approx(13 * 0.2 * 1.5 * 300)
    assert est[1]["bound_by"] == "cores" and est[1]["run_s_estimate"] == pytest.approx(1.3 * 300)
    assert "run_s_estimate" not in est[2]
    # as many arms as candidates ran side by side (or fewer): the calibration's step already bore
    # that load, no x 1.3 (calibration 4 passed over its only candidate under 0.95 for it)
    evidence._estimate_runs(est, steps=300, arms=2, side_by_side=1.3)
    assert est[1]["bound_by"] == "cores" and est[1]["run_s_estimate"] == pytest.approx(1.0 * 300)
    assert est[0]["bound_by"] == "cores" and est[0]["run_s_estimate"] == pytest.approx(1.5 * 300)
    failed = [{**row("x", 0.5, 0.7, 1), "ran": False, "error": "the warm start failed: boom"}]
    with pytest.raises(evidence.EvidenceError, match="no candidate ran a step: x: the warm start failed: boom"):
        evidence.choose(failed, 0.95)


def test_default_candidates_are_cheapest_first_and_their_warm_starts_can_be_carried():
    """The next session's calibration takes DEFAULT_CANDIDATES as they are: each must parse, they
    must come cheapest first (a step costs about layers x experts: the calibration takes the first
    that qualifies), and each warm start's fp32 state.pt must fit what evidence.sh collects and a
    later session carries (its WARM_MAX_BYTES)."""
    import re
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions

    script = (Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "evidence.sh").read_text()
    limit_mib = int(re.search(r"^WARM_MAX_BYTES=\$\(\((\d+) \* 1024 \* 1024\)\)", script, re.M).group(1))
    cands = [evidence_config.parse_candidate(s, EvidenceModelShape(), WarmStartOptions())
             for s in evidence_config.DEFAULT_CANDIDATES]
    assert 4 <= len(cands) <= 6 and len({c.name for c in cands}) == len(cands)
    # the run's own (bf16) trainer first, cheapest first; an fp32-trainer fallback only after all of them
    own = [c for c in cands if c.trainer_dtype is None]
    assert cands[:len(own)] == own and all(c.trainer_dtype == "fp32" for c in cands[len(own):])
    costs = [c.shape.layers * c.shape.experts for c in own]
    assert costs == sorted(costs), [c.name for c in cands]
    # a candidate's trainer dtype reaches its GRPO options (the calibration arm's and, if chosen, the run's)
    from r3bridge.demo.evidence_config import GRPOOptions
    fp32 = evidence_config.parse_candidate("L2-E8-k2-aux0.4-fp32", EvidenceModelShape(), WarmStartOptions())
    assert fp32.trainer_dtype == "fp32" and fp32.aux_loss == 0.4 and fp32.shape.layers == 2
    assert fp32.grpo(GRPOOptions(trainer_dtype="bf16")).trainer_dtype == "fp32"
    assert own[0].grpo(GRPOOptions(trainer_dtype="bf16")).trainer_dtype == "bf16"       # None: the run's own
    with pytest.raises(ValueError, match="cannot read 'fp16'"):
        evidence_config.parse_candidate("L2-E8-k2-fp16", EvidenceModelShape(), WarmStartOptions())
    for c in cands:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(c.shape.hf_config(), dtype=torch.float32)
        mib = sum(v.numel() * 4 for v in model.state_dict().values()) / 2**20
        assert mib < limit_mib - 1, f"{c.name}: its warm start's state.pt ({mib:.1f} MiB) cannot be carried"


def test_source_commit_prefers_the_commit_the_runner_names(monkeypatch):
    """On the device the tree is a copy whose .git can be older than its files: R3BRIDGE_COMMIT, when
    set, is what run.json records; unset, a checkout's HEAD (this one's)."""
    from pathlib import Path

    monkeypatch.delenv("R3BRIDGE_COMMIT", raising=False)
    here = evidence.source_commit()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(evidence.__file__).parent, capture_output=True,
                          text=True).stdout.strip()
    # a checkout: its HEAD (-dirty while files differ); a tree without .git: unknown
    assert (here or "").split("-")[0] == head
    monkeypatch.setenv("R3BRIDGE_COMMIT", "33cfc8e")
    assert evidence.source_commit() == "33cfc8e"
