"""SGLang's returned routes as the engine hands them, and the every-format fixtures (tests only).

SGLang (read from the 0.5.12 wheel: ``srt/managers/detokenizer_manager.py`` ``_b64_encode_per_request``,
``srt/managers/tokenizer_manager.py`` where ``meta_info["routed_experts"]`` is set, and
``srt/state_capturer/routed_experts.py``) returns ``meta_info["routed_experts"]``: base64 of the
int32 capture buffer's bytes, flat ``[prompt + completion - 1 - routed_experts_start_len,
num_hidden_layers, top_k]`` (token-major, then layer, then k), dense layers as zero rows; the
OpenAI endpoints put the same string in each choice's ``sgl_ext.routed_experts``. From 0.5.11 the
tokenizer manager also encodes the ``skip_tokenizer_init`` path (a tensor before). SGLang #31219
(open) adds ``meta_info["routed_experts_dtype"]`` naming a narrower wire (``uint16`` / ``uint8``).

:func:`meta_info` builds one response; :func:`sglang_format_problems` checks a recorded one;
:func:`format_fixtures` writes ``tests/fixtures/engine_formats/`` (every format r3bridge decodes,
built from routes a real vLLM 0.24 returned on a GPU: ``tests/fixtures/vllm/``).
"""
from __future__ import annotations

import base64
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from testlab.vllm_payloads import auxoutput_emissions, auxoutput_keys, load_payloads, npy_base64, split_v021

__all__ = ["meta_info", "sglang_format_problems", "format_fixtures", "FIXTURE_DIR", "load_format_fixture",
           "replay_recorded_rank"]

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                           "engine_formats")
_WIRE = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}


def meta_info(routes: np.ndarray, prompt_len: int, completion_len: int, *, wire_dtype: Optional[str] = None,
              openai: bool = False) -> dict[str, Any]:
    """One SGLang response's ``meta_info`` (``openai``: the routes in ``sgl_ext`` as the OpenAI
    endpoints return them) with ``routes`` ``[rows, num_hidden_layers, K]`` on the wire:
    int32 base64, or ``wire_dtype`` named in ``routed_experts_dtype`` (#31219)."""
    wire = np.ascontiguousarray(np.asarray(routes).astype(_WIRE[wire_dtype or "int32"]))
    b64 = base64.b64encode(wire.tobytes()).decode("utf-8")
    out: dict[str, Any] = {"prompt_tokens": int(prompt_len), "completion_tokens": int(completion_len)}
    if openai:
        out["sgl_ext"] = {"routed_experts": b64}
    else:
        out["routed_experts"] = b64
    if wire_dtype is not None:
        out["routed_experts_dtype"] = wire_dtype
    return out


def sglang_format_problems(meta: Any, *, num_hidden_layers: int, topk: int, num_experts: int,
                           moe_layer_ids: Sequence[int], start: int = 0) -> list[str]:
    """What in one recorded ``meta_info`` deviates from SGLang's format: the field, base64, int32
    whole rows, ``prompt + completion - 1 - start`` rows, dense layers zero, ids in range."""
    if not isinstance(meta, dict) or not isinstance(meta.get("routed_experts"), str):
        return [f"meta_info routed_experts is {type((meta or {}).get('routed_experts')).__name__}, not a base64 str"]
    raw = base64.b64decode(meta["routed_experts"])
    if len(raw) % 4:
        return [f"{len(raw)} bytes, not int32 values"]
    flat = np.frombuffer(raw, dtype="<i4")
    rows = int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1 - int(start)
    if flat.size != rows * num_hidden_layers * topk:
        return [f"{flat.size} ids, expected {rows} rows x {num_hidden_layers} layers x top-{topk}"]
    a = flat.reshape(rows, num_hidden_layers, topk)
    problems = []
    dense = [i for i in range(num_hidden_layers) if i not in set(int(x) for x in moe_layer_ids)]
    if dense and a[:, dense].any():
        problems.append(f"dense layers {dense} hold non-zero ids")
    moe = a[:, [int(i) for i in moe_layer_ids]]
    if moe.size and (moe.min() < 0 or moe.max() >= num_experts):
        problems.append(f"ids outside [0, {num_experts}): {int(moe.min())}..{int(moe.max())}")
    return problems


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return {"dtype": x.dtype.name, "shape": list(x.shape), "data": x.tolist()}
    if isinstance(x, (bytes, bytearray)):
        return {"base64": base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def _from_json(x: Any) -> Any:
    if isinstance(x, dict) and set(x) == {"dtype", "shape", "data"}:
        return np.asarray(x["data"], dtype=x["dtype"]).reshape(x["shape"])
    if isinstance(x, dict) and set(x) == {"base64"}:
        return base64.b64decode(x["base64"])
    if isinstance(x, dict):
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


def load_format_fixture(name: str, directory: str = FIXTURE_DIR) -> dict[str, Any]:
    """One fixture: ``engine``, ``version``, ``format``, ``built_from``, ``expected`` (the routes
    the payload must decode to), ``payload`` (and ``store`` for by-reference keys)."""
    with open(os.path.join(directory, f"{name}.json")) as f:
        return _from_json(json.load(f))


def format_fixtures(out_dir: str = FIXTURE_DIR, vllm_dir: Optional[str] = None) -> list[str]:
    """Write one JSON fixture per shipped format (and the refused double-encoded SGLang string),
    each built from a route array a real vLLM 0.24.0 returned on an H200 (``recorded: true``)."""
    vllm_dir = vllm_dir or os.path.join(os.path.dirname(FIXTURE_DIR), "vllm")
    dense = load_payloads(os.path.join(vllm_dir, "vllm_routes_e320_dense_first.npz"))   # 320 experts, layer 0 dense
    start = load_payloads(os.path.join(vllm_dir, "vllm_routes_prompt_start.npz"))       # request 1 from token 22
    assert dense.meta["recorded"] and start.meta["recorded"]
    facts = {k: dense.meta[k] for k in ("num_experts", "num_hidden_layers", "topk", "moe_layer_ids")}
    r, p, o = dense.routes[1], len(dense.prompts[1]), len(dense.outputs[1])
    rs, ps, s = start.routes[1], len(start.prompts[1]), start.prompt_starts[1]
    src = "tests/fixtures/vllm/vllm_routes_e320_dense_first.npz request 1 (vLLM 0.24.0, H200, recorded)"
    srcs = "tests/fixtures/vllm/vllm_routes_prompt_start.npz request 1 (vLLM 0.24.0, H200, recorded, start 22)"
    keys, store = auxoutput_keys(r, 16, "r3bridge-fixture")
    cases = {
        "vllm_0.21_split": dict(version="0.21.0", format="vllm-split-int16", model=facts, prompt_len=p,
                                expected=r[:, facts["moe_layer_ids"]].astype(np.int16), start_row=0,
                                payload=split_v021(r, p, facts["moe_layer_ids"]), built_from=src),
        "vllm_0.26_npy_base64": dict(version="0.26.0", format="vllm-array", model=facts, prompt_len=p,
                                     expected=r, start_row=0, payload=npy_base64(r), built_from=src),
        "vllm_0.31_auxoutput_emissions": dict(
            version="0.31.0", format="vllm-auxoutput", model=start.meta and {k: start.meta[k] for k in facts},
            prompt_len=ps, expected=rs, start_row=s, payload=auxoutput_emissions(rs, ps, s), built_from=srcs),
        "vllm_0.31_auxoutput_keys": dict(version="0.31.0", format="vllm-auxoutput", model=facts, prompt_len=p,
                                         expected=r[:len(keys) * 16], start_row=0, payload=keys, store=store,
                                         dtype=r.dtype.name, built_from=src + ", whole 16-row blocks"),
        "sglang_0.5.10_int32": dict(version="0.5.10", format="sglang-int32", model=facts, prompt_len=p,
                                    expected=r.astype(np.int32), start_row=0, payload=meta_info(r, p, o),
                                    built_from=src + ", re-encoded as SGLang's int32 base64"),
        "sglang_0.5.12_openai_sgl_ext": dict(version="0.5.12", format="sglang-int32-base64", model=facts,
                                             prompt_len=p, expected=r.astype(np.int32), start_row=0,
                                             payload=meta_info(r, p, o, openai=True),
                                             built_from=src + ", re-encoded as SGLang's sgl_ext field"),
        "sglang_31219_uint16_wire": dict(version="0.5.12", format="sglang-wire-dtype", model=facts, prompt_len=p,
                                         expected=r.astype(np.int32), start_row=0,
                                         payload=meta_info(r, p, o, wire_dtype="uint16"),
                                         built_from=src + ", as SGLang #31219's uint16 wire"),
    }
    twice = meta_info(r, p, o)
    twice["routed_experts"] = base64.b64encode(twice["routed_experts"].encode("utf-8")).decode("utf-8")
    cases["sglang_0.5.12_double_base64_refused"] = dict(
        version="0.5.12", format="refused", model=facts, prompt_len=p, expected=None, start_row=0, payload=twice,
        built_from=src + ", encoded twice as a re-encoding client does (dynamo #10543)")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, case in cases.items():
        engine = "vllm" if name.startswith("vllm") else "sglang"
        path = os.path.join(out_dir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(_jsonable({"engine": engine, "name": name, **case}), f, sort_keys=True, separators=(",", ":"))
            f.write("\n")
        written.append(path)
    return written


def replay_recorded_rank(ctx: Any, cases: Sequence[str], seed: int) -> dict[str, dict]:
    """A rank function (``spawn_layouts``): the recorded SGLang cases of one model (names of
    ``tests/fixtures/sglang`` or paths of ``.json`` files) replayed in the megatron-core model
    converted from the HF model the engine served (``sglang_routes.replay_rank``)."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for p in (os.path.join(root, "scripts", "gpu"), os.path.join(root, "tests", "megatron")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import sglang_routes

    payloads = []
    for case in cases:
        path = case if case.endswith(".json") else os.path.join(os.path.dirname(FIXTURE_DIR), "sglang",
                                                                 f"sglang_routes_{case}.json")
        with open(path) as f:
            payloads.append(json.load(f))
    return sglang_routes.replay_rank(ctx, payloads, seed)


if __name__ == "__main__":      # python -m testlab.sglang_payloads [tests/fixtures/engine_formats]
    import sys

    for path in format_fixtures(*(sys.argv[1:2])):
        print(path, os.path.getsize(path))
