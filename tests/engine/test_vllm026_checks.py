"""The row-by-row checks ``scripts/gpu/vllm026_routes.py`` ran on vLLM 0.26.0's speculative-decoding
payloads, rerun on the CPU from what vLLM 0.26.0 returned on 1 x H200 (``tests/fixtures/vllm026/``,
2026-11-29, docs/gpu-results/vllm-0.26.0).

The run (``vllm026_device.sh variants``, variant ``inproc_hd64``) served model A (4 MoE layers, 32
experts top-4) three times with the same settings: ``spec_reference`` (no speculation), ``spec_ngram``
(prompt lookup) and ``spec_draft`` (a one-layer MoE draft model). Here: both speculative runs'
routes equal the reference's row by row (and byte for byte) with the same outputs, and neither
``agreement_canaries`` comparison (against the reference, against the fp32 HF model) says a word;
the script's comparisons recomputed here give the numbers its ``vllm026_routes.json`` recorded.
A payload whose layer 0 holds the draft model's choices (vLLM #48622's corruption before 0.26.0,
written here over the real draft run's routes) is valid in every shape and dtype, decodes through
0.26.0's decoder, and only the canary names it. Every recorded payload (the direct cases too)
replays exactly under R3 in the megatron-core model converted from the HF model vLLM served.

**Heads of 64.** The device run set ``R3E2E_HEAD_DIM=64`` (recorded in ``vllm026_routes.json``'s
``variant_environment``; heads of 8 stall in 0.26.0's FlashAttention call). The weights are drawn
per parameter name and shape, so the fp32 HF reference (and the draft model) are rebuilt here with
the recorded head width, through the same ``tiny_qwen3_moe`` and environment variable the device
used; built with the default heads of 8 the same seed is another model (agreement near 0).
"""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from testlab.gpu_scripts import gpu_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "vllm026")
SPEC_RUNS = ("spec_ngram", "spec_draft")


def recorded_summary() -> dict:
    with open(os.path.join(FIXTURES, "vllm026_routes.json")) as f:
        return json.load(f)


def _models(head_dim: str):
    """Model A's fp32 HF reference, its facts and the draft model, built as the device run built
    them with ``R3E2E_HEAD_DIM=head_dim``."""
    from r3bridge.demo.hf_engine import build_hf_model

    v = gpu_script("vllm026_routes")
    routes = gpu_script("vllm_routes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R3E2E_HEAD_DIM", head_dim)
        cfg, dcfg = routes.hf_config(routes.MODEL_A), v.draft_config()
    assert cfg.head_dim == dcfg.head_dim == int(head_dim)
    ref = v.hf_reference(cfg, build_hf_model(cfg, seed=routes.MODEL_A.seed, router_std=routes.ROUTER_STD).state_dict())
    draft = v.hf_reference(dcfg, build_hf_model(dcfg, seed=v.DRAFT_SEED, router_std=routes.ROUTER_STD).state_dict())
    return routes._facts(cfg), ref, draft


@pytest.fixture(scope="module")
def setup():
    """The three recorded runs, and model A's HF reference and draft with the run's head width."""
    from testlab.vllm_payloads import load_payloads

    v = gpu_script("vllm026_routes")
    summary = recorded_summary()
    assert summary["ran"] is True and summary["environment"]["vllm"] == "0.26.0"
    head_dim = summary["variant_environment"]["R3E2E_HEAD_DIM"]
    assert head_dim == "64"
    pays = {n: load_payloads(os.path.join(FIXTURES, f"vllm026_{n}.npz")) for n in ("spec_reference", *SPEC_RUNS)}
    facts, ref, draft = _models(head_dim)
    return v, pays, facts, ref, draft, summary


def _draft_wrote_layer_0(pay, draft):
    """vLLM #48622's payload: every request's layer-0 rows hold the draft model's top-k for the same tokens."""
    from sglang_routes import hf_routes

    bad = copy.deepcopy(pay)
    for i, r in enumerate(bad.routes):
        r[:, 0] = hf_routes(draft, bad.tokens(i), [0])[:, 0].astype(r.dtype)
    return bad


@pytest.mark.parametrize("name", SPEC_RUNS)
def test_speculative_runs_replay_the_reference_row_by_row(setup, name):
    v, pays, facts, ref, _, summary = setup
    base, pay = pays["spec_reference"], pays[name]
    counters = pay.meta["spec_counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0 and counters["vllm:spec_decode_num_draft_tokens"] > 0
    assert pay.meta["speculative_config"]["method"] == {"spec_ngram": "ngram", "spec_draft": "draft_model"}[name]
    assert pay.outputs == base.outputs                             # greedy: speculation changes no token
    assert all(np.array_equal(a, b) for a, b in zip(pay.routes, base.routes))
    cmp = v._merged(pay, base, None, facts)
    assert cmp["rows"] == 193 and cmp["agreement"] == 1.0 and cmp["differing"] == {}
    assert all(agree == rows == 193 for agree, rows in cmp["per_layer"].values())
    assert v.canaries(cmp) == [] and v.canaries(v._merged(pay, None, ref, facts)) == []
    assert v.decode_check(pay, pay.meta["version"]) == {"decode": "ok", "rows": 193}
    recorded = summary["cases"][name]["vs_reference"]               # what the device computed, recomputed here
    assert cmp["prompt"] == recorded["prompt"] and cmp["generated"] == recorded["generated"]
    assert {str(k): val for k, val in cmp["per_layer"].items()} == recorded["per_layer"]


def test_the_hf_reference_needs_the_runs_head_width(setup):
    """bf16 engine vs fp32 HF with heads of 64: drift (0.88-0.99 per layer), not replay, and the
    device's numbers exactly; with the default heads of 8 the same seed is another model."""
    v, pays, facts, ref, _, summary = setup
    for name, pay in pays.items():
        got = v.hf_check(pay, ref, facts)
        assert got["hf_agreement_per_layer"] == summary["cases"][name]["hf_agreement_per_layer"]
        assert 0.85 < min(got["hf_agreement_per_layer"]) and got["hf_agreement"] < 1.0
    facts8, ref8, _ = _models("8")
    assert v.hf_check(pays["spec_reference"], ref8, facts8)["hf_agreement"] < 0.1


def test_a_draft_written_layer_0_is_silent_but_for_the_canary(setup):
    v, pays, facts, ref, draft, _ = setup
    pay = pays["spec_draft"]
    bad = _draft_wrote_layer_0(pay, draft)
    assert bad.problems() == []                                  # every shape, dtype and id valid
    assert v.decode_check(bad, pay.meta["version"]) == {"decode": "ok", "rows": 193}
    vs_hf = v._merged(bad, None, ref, facts)
    agree0, rows0 = vs_hf["per_layer"][0]
    assert rows0 == 193 and agree0 / rows0 < 0.25
    [warning] = v.canaries(vs_hf)
    assert "layer 0 collapsed" in warning and "#48622" in warning
    vs_reference = v._merged(bad, pays["spec_reference"], None, facts)   # the run without speculation
    assert all(a == n == 193 for lid, (a, n) in vs_reference["per_layer"].items() if lid != 0)
    assert vs_reference["per_layer"][0][0] / vs_reference["per_layer"][0][1] < 0.25
    assert all(layers == [0] for diffs in vs_reference["differing"].values() for _, layers in diffs)
    [warning] = v.canaries(vs_reference)
    assert "layer 0 collapsed" in warning


def test_rows_are_compared_only_over_the_tokens_both_runs_share(setup):
    """A speculative run whose greedy output leaves the reference's at generated token 3 of request
    0 is compared over the prompt and the 3 shared tokens' rows only; a row that differs there is
    listed with its layers and counted as a prompt or generated row."""
    v, pays, facts, _, _, _ = setup
    pay = pays["spec_reference"]
    other = copy.deepcopy(pays["spec_draft"])
    other.outputs[0][3] = (other.outputs[0][3] + 1) % 64
    p0 = len(pay.prompts[0])
    r = other.routes[0]
    r[p0 + 1, 2, 0] = next(e for e in range(32) if e not in set(pay.routes[0][p0 + 1, 2].tolist()))
    cmp = v._merged(other, pay, None, facts)
    assert cmp["rows"] == sum(len(x) for x in pay.routes) - (len(pay.routes[0]) - (p0 + 3))
    assert cmp["differing"] == {0: [[p0 + 1, [2]]]}
    assert cmp["prompt"] == [0, sum(len(p) for p in pay.prompts)] and cmp["generated"][0] == 1


RECORDED_CASES = ("chunked_prefill", "prefix_cache", "prompt_start", "e320_dense_first", "spec_reference", *SPEC_RUNS)


def test_the_recorded_routes_replay_exactly_in_megatron():
    """Every recorded 0.26.0 payload (the direct cases, model B's 320 experts with a dense layer 0
    among them, and the three speculative-decoding runs) replayed under R3 in the megatron-core
    model converted from the HF model vLLM served (heads of 64, one gloo rank, local spec, fp32):
    every router row dispatches exactly vLLM's routes, read through 0.26.0's decoder. The native pass (megatron's own fp32 routing) agrees with vLLM as the
    fp32 HF model did on the GPU (0.87-0.95): the converted model is the one vLLM served."""
    from r3bridge.testing.harness.dist import Layout, spawn_layouts
    from testlab.vllm_payloads import replay_recorded_rank

    summary = recorded_summary()
    head_dim = int(summary["variant_environment"]["R3E2E_HEAD_DIM"])
    paths = [os.path.join(FIXTURES, f"vllm026_{c}.npz") for c in RECORDED_CASES]
    [[out]] = spawn_layouts(replay_recorded_rank, world_size=1, layouts=[Layout()], args=(paths, head_dim),
                            timeout=600)
    assert sorted(out) == sorted(RECORDED_CASES)
    for case, o in out.items():
        assert o["result"] == "exact", (case, o)
        assert o["r3_rows"] == len(o["replayer_layers"]) * o["rows"] > 0 and o["r3_mismatching_rows"] == 0 and not o["errors"], (case, o)
        recorded = summary["cases"][case]                   # the fp32 HF model's agreement with vLLM on the GPU
        assert o["rows"] == recorded["rows"] and abs(o["native_agreement"] - recorded["hf_agreement"]) <= 0.01, (case, o)
        assert o["native_agreement"] < 1.0                     # bf16 engine vs fp32 trainer: R3 is what makes it exact
    assert out["spec_ngram"]["rows"] == out["spec_draft"]["rows"] == out["spec_reference"]["rows"] == 193


DEVICE_SH = os.path.join(ROOT, "scripts", "gpu", "vllm026_device.sh")
FAULT_DIR = os.path.join(ROOT, "scripts", "gpu", "vllm026_faulthandler")


def _variants(tmp_path, hang: str, *args: str, order: str | None = None):
    """``vllm026_device.sh variants`` on the CPU (VLLM026_DRY_RUN: the routes script parses its real
    arguments and stops; the variants named in ``hang`` report a hang as a probe that timed out)."""
    import subprocess
    import sys

    env = dict(os.environ, OUT=str(tmp_path), VLLM026_DRY_RUN="1", R3B_DRY_FAIL=hang,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("VARIANTS", None)
    if order is not None:
        env["VARIANTS"] = order
    p = subprocess.run(["bash", DEVICE_SH, "variants", *args], env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, (tmp_path / "variants.txt").read_text().splitlines(), p.stdout


FIRST_CALL = "inproc inproc_noroutes inproc_small_kv"     # the first device call's order


@pytest.mark.parametrize("order, hang, probed, chosen", [
    (FIRST_CALL, "", ["inproc"], "inproc"),                           # (a) returns: straight to the full run
    (FIRST_CALL, "inproc", ["inproc", "inproc_noroutes", "inproc_small_kv"], "inproc_small_kv"),
    (FIRST_CALL, "inproc inproc_small_kv", ["inproc", "inproc_noroutes", "inproc_small_kv"], None),
    ("inproc_fa2 inproc_flex fa2", "inproc_fa2", ["inproc_fa2", "inproc_flex"], "inproc_flex"),  # the 2nd call's
    (None, "inproc_hd64", ["inproc_hd64", "inproc_triton_hd64"], "inproc_triton_hd64"),  # the default order now
    (None, "inproc_hd64 inproc_triton_hd64", ["inproc_hd64", "inproc_triton_hd64", "inproc_sync"], None),
])
def test_the_first_variant_that_returns_routes_goes_on_to_the_full_run(tmp_path, order, hang, probed, chosen):
    """(b), routes off, returning is evidence about (a), never the variant the full run uses."""
    rc, lines, out = _variants(tmp_path, hang, "--budget", "240", "--gpu-mem", "0.1", order=order)
    assert [ln.split()[1].rstrip(":") for ln in lines if ln.startswith("probe ")] == probed
    for ln in lines:
        if ln.startswith("probe "):
            name = ln.split()[1].rstrip(":")
            assert ln.split()[3] == ("1" if name in hang.split() else "0")
            assert (tmp_path / f"probe_{name}.log").exists()
    if chosen is None:
        assert rc == 1 and lines[-1] == "no variant returned routes"
        return
    assert rc == 0 and f"chosen {chosen}; full run in" in "\n".join(lines)
    full = [json.loads(ln) for ln in (tmp_path / "full.log").read_text().splitlines() if ln.startswith("{")]
    assert full[-1]["variant"] == chosen and full[-1]["probe"] is False and full[-1]["out"] == str(tmp_path / "full")
    assert full[-1]["environment"] == v_environment(chosen)


def v_environment(variant):
    return gpu_script("vllm026_routes").VARIANTS[variant][0]


def test_a_second_call_goes_straight_to_the_variant_a_first_one_found(tmp_path):
    rc, lines, _ = _variants(tmp_path, "inproc", order="inproc_small_kv")
    assert rc == 0 and lines[0].startswith("probe inproc_small_kv: rc 0") and lines[1].startswith("chosen inproc_small_kv")


def test_no_full_run_without_time_left(tmp_path):
    rc, lines, _ = _variants(tmp_path, "", "--budget", "30")
    assert rc == 1 and lines[-1].startswith("chosen inproc_hd64; ") and lines[-1].endswith("no full run")
    assert not (tmp_path / "full.log").exists()


def test_variant_arguments():
    v = gpu_script("vllm026_routes")
    with pytest.raises(SystemExit):                          # routes off: a probe only, never the full run
        v.main(["--variant", "inproc_noroutes", "--dry-run"])
    with pytest.raises(SystemExit):
        v.main(["--probe", "--spec-only", "--dry-run"])
    assert v.ROUTES_OFF == {"inproc_noroutes"}
    assert v.PROBE_ONLY == {"inproc_noroutes", "inproc_sync", "inproc_noaot", "inproc_hd8_long"}
    with pytest.raises(SystemExit):                          # a diagnosis is never the full run's settings
        v.main(["--variant", "inproc_sync", "--dry-run"])
    text = open(DEVICE_SH).read()                            # the device script's list is the same set
    [line] = [ln for ln in text.splitlines() if ln.strip().startswith("PROBE_ONLY=")]
    assert set(line.split('"')[1].split()) == v.PROBE_ONLY
    import argparse

    small = v.engine_overrides(argparse.Namespace(variant="inproc_small_kv", no_async_scheduling=True))
    assert small == {"num_gpu_blocks_override": v.SMALL_KV_BLOCKS, "async_scheduling": False}


def test_every_process_dumps_its_stacks_when_it_hangs():
    """The faulthandler folder's sitecustomize: a process and the child it starts (as vLLM starts its
    engine core) both dump their stacks and exit after R3B_FAULT_AFTER s."""
    import subprocess
    import sys

    child = "import time; time.sleep(30)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)"
    env = dict(os.environ, PYTHONPATH=FAULT_DIR, R3B_FAULT_AFTER="1")
    p = subprocess.run([sys.executable, "-c", parent], env=env, capture_output=True, text=True, timeout=25)
    assert p.returncode != 0
    assert p.stderr.count("Timeout (0:00:01)!") == 2 and p.stderr.count("most recent call first") >= 2
