"""The row-by-row checks ``scripts/gpu/vllm026_routes.py`` runs on vLLM 0.26.0's speculative-decoding
payloads, exercised on routes a real vLLM returned (``tests/fixtures/vllm/``, vLLM 0.24.0 on the GPU).

vLLM 0.26.0 itself has not returned a payload yet: it installed and started on the H200 but its
``generate`` did not come back (docs/gpu-results/vllm-0.26.0/README.md). What the script will
conclude from such a payload is tested here: a payload whose layer 0 holds a draft model's choices
(vLLM #48622's corruption, before 0.26.0) is valid in every shape and dtype, decodes through the
0.22-0.30 decoder as "0.26.0", and only ``agreement_canaries`` names it, against the HF reference
and against the run without speculation alike; the clean payload raises no canary.
"""
from __future__ import annotations

import copy
import json
import os

import pytest

from testlab.gpu_scripts import gpu_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "vllm", "vllm_routes_chunked_prefill.npz")


@pytest.fixture(scope="module")
def setup():
    """The recorded payload (model A: 4 MoE layers, 32 experts top-4), the HF model it was served
    from (fp32) and the script's one-layer MoE draft model, as the GPU run builds them."""
    from r3bridge.demo.hf_engine import build_hf_model
    from testlab.vllm_payloads import load_payloads

    v = gpu_script("vllm026_routes")
    routes = gpu_script("vllm_routes")
    pay = load_payloads(FIXTURE)
    cfg = routes.hf_config(routes.MODEL_A)
    facts = routes._facts(cfg)
    ref = v.hf_reference(cfg, build_hf_model(cfg, seed=routes.MODEL_A.seed, router_std=routes.ROUTER_STD).state_dict())
    draft = v.hf_reference(v.draft_config(), build_hf_model(v.draft_config(), seed=v.DRAFT_SEED,
                                                            router_std=routes.ROUTER_STD).state_dict())
    return v, pay, facts, ref, draft


def _draft_wrote_layer_0(pay, draft):
    """vLLM #48622's payload: every request's layer-0 rows hold the draft model's top-k for the same tokens."""
    from sglang_routes import hf_routes

    bad = copy.deepcopy(pay)
    for i, r in enumerate(bad.routes):
        r[:, 0] = hf_routes(draft, bad.tokens(i), [0])[:, 0].astype(r.dtype)
    return bad


def test_clean_payload_raises_no_canary(setup):
    v, pay, facts, ref, _ = setup
    vs_hf = v._merged(pay, None, ref, facts)
    assert vs_hf["rows"] == sum(len(r) for r in pay.routes) == 141
    assert 0.9 < vs_hf["agreement"] < 1.0                       # bf16 engine vs fp32 reference: drift, not replay
    assert v.canaries(vs_hf) == []
    same = v._merged(pay, pay, None, facts)
    assert same["agreement"] == 1.0 and same["differing"] == {} and v.canaries(same) == []
    assert v.decode_check(pay, "0.26.0") == {"decode": "ok", "rows": 141}


def test_a_draft_written_layer_0_is_silent_but_for_the_canary(setup):
    v, pay, facts, ref, draft = setup
    bad = _draft_wrote_layer_0(pay, draft)
    assert bad.problems() == []                                  # every shape, dtype and id valid
    assert v.decode_check(bad, "0.26.0") == {"decode": "ok", "rows": 141}
    vs_hf = v._merged(bad, None, ref, facts)
    agree0, rows0 = vs_hf["per_layer"][0]
    assert rows0 == 141 and agree0 / rows0 < 0.25
    [warning] = v.canaries(vs_hf)
    assert "layer 0 collapsed" in warning and "#48622" in warning
    vs_reference = v._merged(bad, pay, None, facts)              # the run without speculation, same tokens
    assert all(a == n for lid, (a, n) in vs_reference["per_layer"].items() if lid != 0)
    assert vs_reference["per_layer"][0][0] / vs_reference["per_layer"][0][1] < 0.25
    assert all(layers == [0] for diffs in vs_reference["differing"].values() for _, layers in diffs)
    [warning] = v.canaries(vs_reference)
    assert "layer 0 collapsed" in warning


def test_rows_are_compared_only_over_the_tokens_both_runs_share(setup):
    """A speculative run whose greedy output leaves the reference's at generated token 3 of request
    0 is compared over the prompt and the 3 shared tokens' rows only; a row that differs there is
    listed with its layers and counted as a prompt or generated row."""
    v, pay, facts, _, _ = setup
    other = copy.deepcopy(pay)
    other.outputs[0][3] = (other.outputs[0][3] + 1) % 64
    p0 = len(pay.prompts[0])
    r = other.routes[0]
    r[p0 + 1, 2, 0] = next(e for e in range(32) if e not in set(pay.routes[0][p0 + 1, 2].tolist()))
    cmp = v._merged(other, pay, None, facts)
    assert cmp["rows"] == sum(len(x) for x in pay.routes) - (len(pay.routes[0]) - (p0 + 3))
    assert cmp["differing"] == {0: [[p0 + 1, [2]]]}
    assert cmp["prompt"] == [0, sum(len(p) for p in pay.prompts)] and cmp["generated"][0] == 1


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
