"""vLLM's returned routes as files (``tests/fixtures/vllm/*.npz``) through r3bridge's ingest.

**The fixtures are stand-ins until the recorded ones come back.** They have the names, cases and
format of what ``scripts/gpu/vllm_smoke.py`` and ``scripts/gpu/vllm_routes.py`` record from a
real vLLM on the GPU (``$OUT/vllm_smoke.npz``, ``$OUT/vllm_routes_<case>.npz``), but were made
here by ``python -m testlab.vllm_payloads tests/fixtures/vllm``: a real HF Qwen3-MoE's prefill
routes in vLLM's exact layout and dtype (``meta["recorded"]`` is False, ``meta["engine"]``
``hf-transformers``). Copying the recorded files over them (docs/gpu.md, "Real vLLM on the
device") makes every test here run on what vLLM returned, unchanged.

Where the ingest rules of issue 36 item 5 plug in (implemented on other branches, not here):
a row whose MoE entries are all one expert inside a sample's real tokens (vLLM #54730) is a
"degenerate route", refused or counted, never "no route" (branch ``ingest``): its tests take a
recorded payload from :func:`load` and overwrite one sample's rows, as
:func:`test_format_checker_reports_each_deviation` does; R3 with speculative decoding on a vLLM
older than 0.26.0 is refused naming both settings (branch ``field``): ``meta["version"]`` of a
recorded payload is the version that returned it.

``tests/fixtures/vllm026/``: the same cases plus speculative decoding, recorded from vLLM 0.26.0 on
1 x H200 (2026-11-29, ``scripts/gpu/vllm026_device.sh variants``, variant ``inproc_hd64``:
model A's heads 64 wide, docs/gpu-results/vllm-0.26.0). Each goes through the same checks and,
by its ``meta["version"]``, through the decoder r3bridge's format table picks for that release.
"""
from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from r3bridge import ParallelLayout, PayloadError, ReplayBatch, shard
from r3bridge.engines.route_formats import route_format
from r3bridge.rollout.stitching import rollout_routes
from testlab.gpu_scripts import gpu_script
from testlab.vllm_payloads import load_payloads, route_dtype, vllm_format_problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "vllm")
CASES = ("smoke", "routes_chunked_prefill", "routes_prefix_cache", "routes_prompt_start", "routes_e320_dense_first")
FIXTURES_026 = os.path.join(ROOT, "tests", "fixtures", "vllm026")
CASES_026 = ("chunked_prefill", "prefix_cache", "prompt_start", "e320_dense_first", "spec_reference", "spec_ngram",
             "spec_draft")


def load(case: str):
    return load_payloads(os.path.join(FIXTURES, f"vllm_{case}.npz"))


def load_026(case: str):
    return load_payloads(os.path.join(FIXTURES_026, f"vllm026_{case}.npz"))


@pytest.mark.parametrize("case", [*CASES, *(f"0.26.0/{c}" for c in CASES_026)])
def test_fixture_is_in_vllms_format_and_ingests(case):
    pay = load_026(case.split("/")[1]) if case.startswith("0.26.0/") else load(case)
    m = pay.meta
    assert pay.problems() == []
    arrays = [r for r in pay.routes if r is not None]
    assert arrays and all(r.dtype == route_dtype(m["num_experts"]) for r in arrays)
    dense = [i for i in range(m["num_hidden_layers"]) if i not in m["moe_layer_ids"]]
    if not any(pay.prompt_starts):
        rb = pay.replay_batch()
        assert list(rb.layer_ids) == m["moe_layer_ids"]                 # dense columns dropped by id
        assert rb.rows_per_seq == [len(p) + len(o) - 1 for p, o in zip(pay.prompts, pay.outputs)]
        assert rb.routes.dtype == (torch.uint8 if m["num_experts"] <= 256 else torch.int16)
        first, _ = rb.sequence(0)
        assert torch.equal(first.to(torch.int64), torch.from_numpy(arrays[0][:, m["moe_layer_ids"]].astype(np.int64)))
        # a rank's targets: TP1 holds every row; ids are the engine's, widened to int64
        lens = [len(p) + len(o) for p, o in zip(pay.prompts, pay.outputs)]
        layout = ParallelLayout(m["num_hidden_layers"], [0 if i in dense else 1 for i in range(m["num_hidden_layers"])])
        t = shard(rb, layout, lens)
        lid = m["moe_layer_ids"][0]
        assert t.indices[lid].dtype == torch.int64 and int(t.valid.sum()) == rb.total_rows
        assert torch.equal(t.indices[lid][: lens[0] - 1].sort(-1).values,
                           torch.from_numpy(arrays[0][:, lid].astype(np.int64)).sort(-1).values)
    if dense:
        assert all(not r[:, dense].any() for r in arrays)


@pytest.mark.parametrize("case", CASES_026)
def test_026_payloads_decode_through_their_releases_decoder(case):
    """A recorded 0.26.0 payload names its release (``meta["version"]``); the format table picks the
    0.22-0.30 array decoder for it, and ``from_vllm(engine_version=...)`` gives the batch the plain
    array path gives (start rows kept, dense layers checked empty). The same arrays claimed by
    vLLM 0.21 (split lists) are refused naming that release."""
    pay = load_026(case)
    m = pay.meta
    assert m["engine"] == "vllm" and m["version"] == "0.26.0" and m["recorded"] is True
    assert route_format("vllm", m["version"]).name == "vllm-array"
    kw = dict(num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"], start_rows=pay.prompt_starts)
    by_release = ReplayBatch.from_vllm(list(pay.routes), engine_version=m["version"], **kw)
    plain = ReplayBatch.from_vllm(list(pay.routes), **kw)
    assert by_release.rows_per_seq == plain.rows_per_seq and by_release.routes.tolist() == plain.routes.tolist()
    assert by_release.total_rows == sum(len(r) for r in pay.routes)
    with pytest.raises(PayloadError, match=r"vLLM 0.21.0 ships vllm-split-int16 .*got no prompt_routed_experts"):
        ReplayBatch.from_vllm(list(pay.routes), engine_version="0.21.0", **kw)


def test_026_prompt_start_rows_stitch_into_one_sequence():
    """0.26.0's ``routed_experts_prompt_start`` turn (start 22, 16 tokens from the prefix cache):
    stitched after turn 1's rows, the two calls cover the whole sample once."""
    pay = load_026("prompt_start")
    m = pay.meta
    t1, t2 = pay.routes
    start = pay.prompt_starts[1]
    assert start == len(pay.prompts[0]) + len(pay.outputs[0]) - 1 == len(t1) and m["num_cached_tokens"][1] > 0
    rb = rollout_routes([[t1, t2]], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"],
                        start_rows=[[0, start]])
    assert rb.rows_per_seq == [len(pay.tokens(1)) - 1] and bool(rb.valid.all())
    seq, _ = rb.sequence(0)
    assert torch.equal(seq[start:].to(torch.int64), torch.from_numpy(t2[:, m["moe_layer_ids"]].astype(np.int64)))


def test_prompt_start_rows_stitch_into_one_sequence():
    """Turn 2 asked for rows from ``routed_experts_prompt_start`` (the token turn 1 sampled last):
    stitched after turn 1's rows they cover the whole sample, each row from the call that first
    fed its token."""
    pay = load("routes_prompt_start")
    m = pay.meta
    t1, t2 = pay.routes
    start = pay.prompt_starts[1]
    assert start == len(pay.prompts[0]) + len(pay.outputs[0]) - 1 and len(t1) == start
    rb = rollout_routes([[t1, t2]], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"],
                        start_rows=[[0, start]])
    n = len(pay.tokens(1))
    assert rb.rows_per_seq == [n - 1] and bool(rb.valid.all())
    seq, _ = rb.sequence(0)
    moe = m["moe_layer_ids"]
    assert torch.equal(seq[:start].to(torch.int64), torch.from_numpy(t1[:, moe].astype(np.int64)))
    assert torch.equal(seq[start:].to(torch.int64), torch.from_numpy(t2[:, moe].astype(np.int64)))


@pytest.mark.parametrize("release", ["0.24.0", "0.26.0"])
def test_prefix_cache_hits_return_the_prompt_rows(release):
    """The same prompt served twice from the prefix cache: both requests return every prompt row
    (vLLM reads them from its slot buffer), equal to the first computation's (``meta``, counted
    on the GPU), so the cached requests replay like uncached ones."""
    pay = load("routes_prefix_cache") if release == "0.24.0" else load_026("prefix_cache")
    n = pay.meta["prompt_rows"]
    a, b = pay.routes
    assert len(a) >= n and len(b) >= n and np.array_equal(a[:n], b[:n])
    assert pay.meta["prompt_rows_equal_to_first_computation"] == [n, n]


def test_format_checker_reports_each_deviation():
    """What the device scripts check every returned array with (their exit status rests on it)."""
    pay = load("routes_e320_dense_first")
    m = pay.meta
    good = pay.routes[0]
    kw = dict(prompt_len=len(pay.prompts[0]), output_len=len(pay.outputs[0]), num_hidden_layers=m["num_hidden_layers"],
              topk=m["topk"], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"])
    assert vllm_format_problems(good, **kw) == []
    assert "None" in vllm_format_problems(None, **kw)[0]
    assert any("dtype" in p for p in vllm_format_problems(good.astype(np.uint8), **kw))     # 320 experts in uint8
    assert any("shape" in p for p in vllm_format_problems(good[1:], **kw))                  # a row short
    dense = good.copy()
    dense[3, 0, 0] = 7
    assert any("dense layers [0]" in p for p in vllm_format_problems(dense, **kw))
    degenerate = good.copy()
    degenerate[5:9, 1:] = 0           # vLLM #54730: a fused kernel skipped the capture, every id expert 0
    assert any("repeat an expert id" in p and "first row 5" in p for p in vllm_format_problems(degenerate, **kw))


def test_smoke_check_reads_request_outputs():
    """``scripts/gpu/vllm_smoke.check`` on the recorded payload's requests (``RequestOutput``-shaped
    records: ``prompt_token_ids``, ``outputs[0].token_ids`` / ``routed_experts``)."""
    check = gpu_script("vllm_smoke").check
    pay = load("smoke")
    outs = [types.SimpleNamespace(prompt_token_ids=p, outputs=[types.SimpleNamespace(token_ids=o, routed_experts=r)])
            for p, o, r in zip(pay.prompts, pay.outputs, pay.routes)]
    facts = {k: pay.meta[k] for k in ("num_experts", "num_hidden_layers", "topk", "moe_layer_ids")}
    again, problems = check(pay.prompts, outs, facts)
    assert problems == [] and all(np.array_equal(a, b) for a, b in zip(again.routes, pay.routes))
    outs[1].outputs[0].routed_experts = None       # an aborted request
    assert any("request 1" in p and "None" in p for p in check(pay.prompts, outs, facts)[1])


def test_routes_script_ingests_each_case_as_the_gpu_run_does():
    """``scripts/gpu/vllm_routes.Case.replay_batch``: one call per sample through ``from_vllm``,
    the offset turn through ``rollout_routes``; ``summarize`` passes exact or refused cases only."""
    routes = gpu_script("vllm_routes")
    ps = load("routes_prompt_start")
    facts = {k: ps.meta[k] for k in ("num_experts", "num_hidden_layers", "topk", "moe_layer_ids")}
    case = routes.Case("prompt_start", routes.MODEL_A, [ps.tokens(1)], [list(ps.routes)], [ps.prompt_starts])
    rb = case.replay_batch(facts)
    assert rb.rows_per_seq == [len(ps.tokens(1)) - 1] and bool(rb.valid.all())
    cp = load("routes_chunked_prefill")
    case = routes.Case("chunked_prefill", routes.MODEL_A, [cp.tokens(i) for i in range(4)], [[r] for r in cp.routes],
                       [[0]] * 4)
    assert case.replay_batch(facts).rows_per_seq == [len(cp.tokens(i)) - 1 for i in range(4)]
    assert routes.summarize({"a": {"result": "exact"}, "b": {"result": "refused", "refusal": "CoverageError: ..."}})
    assert not routes.summarize({"a": {"result": "exact"}, "b": {"result": "mismatch"}})
    assert not routes.summarize({"a": {"result": "exact", "format_problems": ["dtype uint8"]}})


@pytest.mark.parametrize("case", ["smoke", "routes_e320_dense_first"])
def test_54730_rows_in_a_payload_are_degenerate_never_no_route(case):
    """Issue 36 item 5 / issue 38 item 1 on vLLM's own payload format: the payload reads clean;
    one sample's MoE ids zeroed inside the rows vLLM returned (vLLM #54730's signature) are counted
    as degenerate by :func:`testlab.engine_report.engine_row_report` and refused by the reader, naming the
    sample, row, token and layer."""
    from r3bridge import rank_targets
    from r3bridge.errors import DegenerateRouteError
    from testlab.engine_report import engine_row_report

    pay = load(case)
    m = pay.meta
    moe = list(m["moe_layer_ids"])
    arrays = [r.copy() for r in pay.routes if r is not None]
    clean = engine_row_report(arrays, num_experts=m["num_experts"], moe_layer_ids=moe)
    assert clean.total_degenerate == 0 and clean.rows == [len(a) for a in arrays]
    arrays[1][3:6, moe] = 0
    report = engine_row_report(arrays, num_experts=m["num_experts"], moe_layer_ids=moe)
    assert report.degenerate_rows[1] == 3 and report.total_degenerate == 3 and report.first == (1, 3, moe[0])
    with pytest.raises(DegenerateRouteError, match=rf"sequence 1, row 3 \(token 3\), layer {moe[0]}: duplicate"):
        engine_row_report(arrays, num_experts=m["num_experts"], moe_layer_ids=moe, refuse=True)
    lens = [len(a) + 1 for a in arrays]
    layout = ParallelLayout(m["num_hidden_layers"], [1 if i in moe else 0 for i in range(m["num_hidden_layers"])])
    with pytest.raises(DegenerateRouteError, match=r"sequence 1, row 3 \(token 3\)"):
        rank_targets(arrays, layout, lens, num_experts=m["num_experts"], moe_layer_ids=moe)
    t = rank_targets(arrays, layout, lens, num_experts=m["num_experts"], moe_layer_ids=moe, degenerate="native")
    assert int((~t.valid).sum()) == 3 + len(arrays)       # the 3 degenerate rows + each sample's last token
