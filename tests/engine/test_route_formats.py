"""Every route format the engines ship, read by release and refused when unknown (issue 46 item 3),
and the raw-bytes decoder (issue 50 item 4).

The fixtures (tests/fixtures/engine_formats/, README there) hold routes a real vLLM 0.24.0
returned on an H200, in each release's wire form as its source defines it; each must decode to
the recorded array, through the table and through ``ReplayBatch.from_vllm`` / ``from_sglang``.
"""
from __future__ import annotations

import base64
import os

import numpy as np
import pytest

from r3bridge import PayloadError, ReplayBatch
from r3bridge.engines.route_formats import (
    ROUTE_FORMATS,
    decode_engine_routes,
    decode_raw_routes,
    route_format,
)
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from testlab.sglang_payloads import FIXTURE_DIR, format_fixtures, load_format_fixture

DECODED = ["vllm_0.21_split", "vllm_0.26_npy_base64", "vllm_0.31_auxoutput_emissions", "vllm_0.31_auxoutput_keys",
           "sglang_0.5.10_int32", "sglang_0.5.12_openai_sgl_ext", "sglang_31219_uint16_wire"]


def _decode(fx, **kw):
    m = fx["model"]
    store = fx.get("store")
    return decode_engine_routes(fx["engine"], fx["payload"], start_row=fx["start_row"],
                                num_hidden_layers=m["num_hidden_layers"], topk=m["topk"],
                                resolve=(lambda keys: b"".join(store[k] for k in keys)) if store else None,
                                dtype=fx.get("dtype"), **kw)


def test_fixtures_are_what_the_builders_write(tmp_path):
    """The committed files are exactly the builders' output from the recorded vLLM arrays."""
    for path in format_fixtures(str(tmp_path)):
        with open(path, "rb") as a, open(os.path.join(FIXTURE_DIR, os.path.basename(path)), "rb") as b:
            assert a.read() == b.read(), os.path.basename(path)


@pytest.mark.parametrize("name", DECODED)
@pytest.mark.parametrize("by", ["release", "own fields"])
def test_each_format_decodes_to_the_recorded_routes(name, by):
    fx = load_format_fixture(name)
    got = _decode(fx, version=fx["version"] if by == "release" else None)
    np.testing.assert_array_equal(got.routes, fx["expected"])
    assert got.start_row == fx["start_row"]
    if by == "release":
        assert got.format == fx["format"] and route_format(fx["engine"], fx["version"]).engine == fx["engine"]


def test_the_table_has_one_row_per_release():
    for engine in ("vllm", "sglang"):
        for v in ("0.21.0", "0.24.0", "0.26.0", "0.31.0", "0.33.0") if engine == "vllm" else ("0.5.10", "0.5.12", "0.5.15"):
            assert sum(f.covers(__import__("packaging.version").version.Version(v))
                       for f in ROUTE_FORMATS if f.engine == engine) == 1, (engine, v)


@pytest.mark.parametrize("name, version, words", [
    # a payload of another release's format: one message naming engine, release and what it ships
    ("vllm_0.21_split", "0.26.0", r"vLLM 0.26.0 ships vllm-array .*got a split payload"),
    ("vllm_0.26_npy_base64", "0.21.0", r"vLLM 0.21.0 ships vllm-split-int16 .*got no prompt_routed_experts"),
    ("vllm_0.31_auxoutput_emissions", "0.24.0", r"vLLM 0.24.0 ships vllm-array .*got an AuxOutput payload"),
    ("sglang_0.5.12_double_base64_refused", "0.5.12", r"SGLang 0.5.12 ships sglang-int32-base64 .*base64 of base64"),
])
def test_a_mismatched_format_is_refused_naming_the_release(name, version, words):
    fx = load_format_fixture(name)
    with pytest.raises(PayloadError, match=words):
        _decode(fx, version=version)


def test_unknown_releases_and_engines_are_refused():
    with pytest.raises(PayloadError, match=r"vLLM 0.20.0: no route format read for this release \(known: >=0.21"):
        route_format("vllm", "0.20.0")
    with pytest.raises(PayloadError, match=r"no route format is known for engine 'lmdeploy'"):
        decode_engine_routes("lmdeploy", [], version="0.9")
    with pytest.raises(PayloadError, match=r"'latest' is not a version number"):
        route_format("sglang", "latest")


def test_double_base64_is_refused_even_without_the_release():
    fx = load_format_fixture("sglang_0.5.12_double_base64_refused")
    with pytest.raises(PayloadError, match=r"base64 of base64 .*dynamo #10543"):
        _decode(fx)


def test_auxoutput_by_reference_needs_a_resolver_and_emissions_must_be_contiguous():
    fx = load_format_fixture("vllm_0.31_auxoutput_keys")
    with pytest.raises(PayloadError, match=r"by reference .*vllm-artifact/.*no resolve= callable"):
        decode_engine_routes("vllm", fx["payload"], version="0.31.0")
    with pytest.raises(PayloadError, match=r"resolve= returned nothing"):
        decode_engine_routes("vllm", fx["payload"], version="0.31.0", num_hidden_layers=4, topk=4, dtype="uint16",
                             resolve=lambda keys: None)
    em = load_format_fixture("vllm_0.31_auxoutput_emissions")
    gap = em["payload"][:3] + em["payload"][4:]
    with pytest.raises(PayloadError, match=r"emission 3 starts at token .* leaves rows"):
        decode_engine_routes("vllm", gap, version="0.31.0", start_row=em["start_row"])
    with pytest.raises(PayloadError, match=r"first emission starts at token 22, the request's routed_experts_prompt_start is 0"):
        decode_engine_routes("vllm", em["payload"], version="0.31.0", start_row=0)


def test_replay_batch_constructors_read_every_format():
    """``from_vllm`` / ``from_sglang`` with ``engine_version`` decode each format and keep the MoE
    layers by id: the same batch as the recorded arrays give."""
    split = load_format_fixture("vllm_0.21_split")
    m = split["model"]
    npy = load_format_fixture("vllm_0.26_npy_base64")
    want = ReplayBatch.from_vllm([npy["expected"]], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"])
    for fx in (split, npy):
        got = ReplayBatch.from_vllm([fx["payload"]], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"],
                                    engine_version=fx["version"])
        assert got.routes.tolist() == want.routes.tolist()
    sniffed = ReplayBatch.from_vllm([split["payload"]], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"])
    assert sniffed.routes.tolist() == want.routes.tolist()
    em = load_format_fixture("vllm_0.31_auxoutput_emissions")
    got = ReplayBatch.from_vllm([em["payload"]], num_experts=em["model"]["num_experts"],
                                moe_layer_ids=em["model"]["moe_layer_ids"], start_rows=[em["start_row"]],
                                engine_version="0.31.0")
    assert got.start_rows == [22] and got.routes.tolist() == em["expected"].tolist()
    for name in ("sglang_0.5.10_int32", "sglang_0.5.12_openai_sgl_ext", "sglang_31219_uint16_wire"):
        fx = load_format_fixture(name)
        got = ReplayBatch.from_sglang([fx["payload"]], num_experts=m["num_experts"], num_layers=m["num_hidden_layers"],
                                      topk=m["topk"], moe_layer_ids=m["moe_layer_ids"], engine_version=fx["version"])
        assert got.routes.tolist() == want.routes.tolist(), name
    with pytest.raises(PayloadError, match=r"SGLang 0.5.12 ships .*base64 of base64"):
        fx = load_format_fixture("sglang_0.5.12_double_base64_refused")
        ReplayBatch.from_sglang([fx["payload"]], num_experts=m["num_experts"], num_layers=m["num_hidden_layers"],
                                topk=m["topk"], engine_version="0.5.12")
    with pytest.raises(PayloadError, match=r"SGLang 0.5.12 ships .*is a ndarray: from 0.5.11 the tokenizer manager"):
        ReplayBatch.from_sglang([{"prompt_tokens": 3, "completion_tokens": 2,
                                  "routed_experts": np.zeros((4, 4, 4), np.int32)}],
                                num_experts=320, num_layers=4, topk=4, engine_version="0.5.12")


# ------------------------------------------------------------------------------------ raw bytes
def test_raw_bytes_checked_on_every_axis():
    """A MoE-only payload whose byte count an every-layer reading also divides is refused naming
    the axis, never reshaped silently (issue 50 item 4)."""
    fx = load_format_fixture("vllm_0.26_npy_base64")
    m, r = fx["model"], fx["expected"]                     # [rows, 4 hidden layers, 4], layers 1-3 MoE
    tokens = r.shape[0] + 1
    got = decode_raw_routes(r.tobytes(), dtype=r.dtype, tokens=tokens, topk=4, layer_axis="all_hidden",
                            num_hidden_layers=4)
    np.testing.assert_array_equal(got, r)
    moe_only = np.ascontiguousarray(r[:, m["moe_layer_ids"]])
    np.testing.assert_array_equal(decode_raw_routes(moe_only.tobytes(), dtype=r.dtype, tokens=tokens, topk=4,
                                                    layer_axis="moe_only", moe_layer_ids=m["moe_layer_ids"]), moe_only)
    # 4 hidden layers x R rows has the bytes of 3 MoE layers x 4R/3 rows: reshape(-1, 4, 4) accepts
    # a MoE-only payload of 3R rows whenever 4 divides; the decoder names the axis instead
    three = np.zeros((12, 3, 4), np.uint16)
    assert np.frombuffer(three.tobytes(), np.uint16).reshape(-1, 4, 4).shape == (9, 4, 4)
    with pytest.raises(PayloadError, match=r"exactly 12 rows x 3 layers: the payload's layer axis is 'moe_only'"):
        decode_raw_routes(three.tobytes(), dtype="uint16", tokens=13, topk=4, layer_axis="all_hidden",
                          num_hidden_layers=4, moe_layer_ids=[1, 2, 3])
    with pytest.raises(PayloadError, match=r"one row fewer"):
        decode_raw_routes(r[:-1].tobytes(), dtype=r.dtype, tokens=tokens, topk=4, layer_axis="all_hidden",
                          num_hidden_layers=4)
    with pytest.raises(PayloadError, match=r"one row more"):
        decode_raw_routes(r.tobytes(), dtype=r.dtype, tokens=tokens, topk=4, layer_axis="all_hidden",
                          num_hidden_layers=4, start_row=1)
    with pytest.raises(RouteShapeError, match=r"need layer_axis"):
        decode_raw_routes(r.tobytes(), dtype=r.dtype, tokens=tokens, topk=4, layer_axis=None, num_hidden_layers=4)
    with pytest.raises(CoverageError, match=r"hold no routes"):
        decode_raw_routes(b"", dtype="uint8", tokens=0, topk=4, layer_axis="all_hidden", num_hidden_layers=4)


def test_sglang_wire_dtype_must_be_known():
    fx = load_format_fixture("sglang_31219_uint16_wire")
    bad = dict(fx["payload"], routed_experts_dtype="int4")
    with pytest.raises(PayloadError, match=r"routed_experts_dtype='int4', not one of"):
        decode_engine_routes("sglang", bad, version="0.5.12", num_hidden_layers=4, topk=4)
    # uint8 wire of a 320-expert model cannot hold its ids: the sizes say so
    short = dict(fx["payload"], routed_experts_dtype="uint8")
    with pytest.raises(PayloadError, match=r"rows"):
        decode_engine_routes("sglang", short, version="0.5.12", num_hidden_layers=4, topk=4)
    assert base64.b64decode(fx["payload"]["routed_experts"])[:2] != b""


def test_ids_on_a_dense_layer_are_refused_when_the_release_is_known():
    """vLLM 0.24-0.26 and SGLang write dense layers as zero rows: with the release given, ids on a
    layer the trainer's model has dense mean the engine served another model."""
    fx = load_format_fixture("vllm_0.26_npy_base64")
    m, r = fx["model"], fx["expected"].copy()                 # layer 0 dense: all zeros as recorded
    assert not r[:, 0].any()
    r[:, 0] = r[:, 1]
    with pytest.raises(LayerMappingError, match=r"layers \[0\] are dense in the trainer's model"):
        ReplayBatch.from_vllm([r], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"], engine_version="0.26.0")
    ReplayBatch.from_vllm([r], num_experts=m["num_experts"], moe_layer_ids=m["moe_layer_ids"])   # release unknown: as before
