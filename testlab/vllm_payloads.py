"""vLLM's returned routes as files: what the GPU scripts record and the CPU tests read (tests only).

vLLM (0.24.0 - 0.26.0) with ``enable_return_routed_experts=True`` hands back, per finished
request, ``CompletionOutput.routed_experts``: a numpy array ``[prompt + generated - 1 - start,
num_hidden_layers, top_k]`` (``start`` = ``SamplingParams.routed_experts_prompt_start``), uint8
up to 256 experts and uint16 above, logical expert ids, dense layers as zero rows
(``routed_experts_capturer.py``: a zero-initialised slot buffer that only MoE layers write).

A payload file (``.npz``, a few KB) holds one case: per request ``routes_<i>`` exactly as the
engine returned it (dtype kept), ``prompt_<i>`` / ``output_<i>`` (token ids) and ``meta`` (a JSON
string: engine and version, the model's ``num_experts`` / ``num_hidden_layers`` / ``top_k`` /
``moe_layer_ids``, per request ``prompt_start``, and ``recorded``: True for arrays a real vLLM
returned on a GPU, False for arrays made here in vLLM's format). :func:`vllm_format_problems`
checks an array against that format; :meth:`Payloads.replay_batch` is the ingest call a user
makes (``ReplayBatch.from_vllm``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["Payloads", "save_payloads", "load_payloads", "vllm_format_problems", "route_dtype", "split_v021",
           "npy_base64", "auxoutput_emissions", "auxoutput_keys"]


def route_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM returns: uint8 up to 256 experts, uint16 above."""
    return np.dtype(np.uint8 if int(num_experts) <= 256 else np.uint16)


@dataclass
class Payloads:
    routes: list[Optional[np.ndarray]]
    prompts: list[list[int]]
    outputs: list[list[int]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_starts(self) -> list[int]:
        return [int(s) for s in self.meta.get("prompt_start") or [0] * len(self.routes)]

    def tokens(self, i: int) -> list[int]:
        return list(self.prompts[i]) + list(self.outputs[i])

    def problems(self) -> list[str]:
        """Every deviation of the recorded arrays from vLLM's format (empty: all as documented)."""
        m = self.meta
        out = []
        for i, r in enumerate(self.routes):
            out += [f"request {i}: {p}" for p in vllm_format_problems(
                r, prompt_len=len(self.prompts[i]), output_len=len(self.outputs[i]),
                num_hidden_layers=int(m["num_hidden_layers"]), topk=int(m["topk"]),
                num_experts=int(m["num_experts"]), moe_layer_ids=m["moe_layer_ids"], start=self.prompt_starts[i])]
        return out

    def replay_batch(self, indices: Optional[Sequence[int]] = None) -> Any:
        """The requests' routes through ``ReplayBatch.from_vllm`` (MoE layers by id, start rows)."""
        from r3bridge.batch.schema import ReplayBatch

        idx = list(range(len(self.routes))) if indices is None else list(indices)
        return ReplayBatch.from_vllm([self.routes[i] for i in idx], num_experts=int(self.meta["num_experts"]),
                                     moe_layer_ids=list(self.meta["moe_layer_ids"]),
                                     start_rows=[self.prompt_starts[i] for i in idx])


def vllm_format_problems(routes: Any, *, prompt_len: int, output_len: int, num_hidden_layers: int, topk: int,
                         num_experts: int, moe_layer_ids: Sequence[int], start: int = 0) -> list[str]:
    """What in one request's ``routed_experts`` deviates from vLLM's documented format: None, type,
    rows (``prompt + output - 1 - start``), layer axis (every hidden layer), top-k, dtype (uint8 /
    uint16 by expert count), non-zero dense-layer rows, ids out of range, repeated ids in a MoE
    row. Rows whose every MoE entry is one id (vLLM #54730's symptom) are reported too."""
    if routes is None:
        return ["routed_experts is None (aborted request, or routes not enabled)"]
    if not isinstance(routes, np.ndarray):
        return [f"routed_experts is a {type(routes).__name__}, not a numpy array"]
    problems = []
    want = (prompt_len + output_len - 1 - start, num_hidden_layers, topk)
    if routes.shape != want:
        problems.append(f"shape {routes.shape}, expected {want} (prompt {prompt_len} + output {output_len} - 1 "
                        f"- start {start}, num_hidden_layers, top_k)")
    if routes.dtype != route_dtype(num_experts):
        problems.append(f"dtype {routes.dtype}, expected {route_dtype(num_experts)} for {num_experts} experts")
    if routes.ndim != 3 or routes.shape[1] != num_hidden_layers or routes.shape[2] != topk:
        return problems
    moe = [int(i) for i in moe_layer_ids]
    dense = [i for i in range(num_hidden_layers) if i not in moe]
    if dense and routes[:, dense].any():
        problems.append(f"dense layers {dense} hold non-zero ids")
    ids = routes[:, moe].astype(np.int64)
    if ids.size and int(ids.max()) >= num_experts:
        problems.append(f"expert id {int(ids.max())} out of range [0, {num_experts})")
    srt = np.sort(ids, axis=-1)
    repeated = (srt[..., 1:] == srt[..., :-1]).any(-1)           # [rows, moe layers]
    if repeated.any():
        rows = np.nonzero(repeated.any(-1))[0]
        problems.append(f"{len(rows)} rows repeat an expert id within a MoE layer's top-k (first row {int(rows[0])})")
    return problems


def save_payloads(path: str, payloads: Payloads) -> str:
    arrays: dict[str, np.ndarray] = {}
    for i, (r, p, o) in enumerate(zip(payloads.routes, payloads.prompts, payloads.outputs)):
        if r is not None:
            arrays[f"routes_{i}"] = np.asarray(r)
        arrays[f"prompt_{i}"] = np.asarray(p, dtype=np.int32)
        arrays[f"output_{i}"] = np.asarray(o, dtype=np.int32)
    meta = {**payloads.meta, "requests": len(payloads.routes)}
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def load_payloads(path: str) -> Payloads:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        n = int(meta["requests"])
        routes = [z[f"routes_{i}"] if f"routes_{i}" in z.files else None for i in range(n)]
        prompts = [z[f"prompt_{i}"].tolist() for i in range(n)]
        outputs = [z[f"output_{i}"].tolist() for i in range(n)]
    return Payloads(routes, prompts, outputs, meta)


def recorded_case(payloads: Payloads, model: Any) -> Any:
    """A recorded payload file as ``scripts/gpu/vllm_routes.Case`` (what its ``replay_case`` takes):
    one sample per request, or, when a request starts at a later row (``prompt_start``), one sample
    of the two calls stitched (the last request's tokens)."""
    import vllm_routes

    facts = {k: payloads.meta[k] for k in ("num_experts", "num_hidden_layers", "topk", "moe_layer_ids")}
    name, n = payloads.meta["case"], len(payloads.routes)
    if any(payloads.prompt_starts):
        return vllm_routes.Case(name, model, [payloads.tokens(n - 1)], [list(payloads.routes)],
                                [payloads.prompt_starts], payloads, facts, payloads.meta.get("version"))
    return vllm_routes.Case(name, model, [payloads.tokens(i) for i in range(n)], [[r] for r in payloads.routes],
                            [[0]] * n, payloads, facts, payloads.meta.get("version"))


def replay_recorded_rank(ctx: Any, paths: Sequence[str], head_dim: int) -> dict[str, dict]:
    """A rank function (``spawn_layouts``): recorded payload files of ``vllm_routes``' models A and B
    (told apart by ``meta["model_seed"]``), served with heads ``head_dim`` wide (vLLM 0.26.0's run:
    64), replayed under R3 in the megatron-core model converted from each HF model
    (``sglang_routes.replay_cases``), every router row checked."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for p in (os.path.join(root, "scripts", "gpu"), os.path.join(root, "tests", "megatron")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import sglang_routes
    import vllm_routes

    out: dict[str, dict] = {}
    pays = [load_payloads(p) for p in paths]
    for model in (vllm_routes.MODEL_A, vllm_routes.MODEL_B):
        cases = [recorded_case(p, model) for p in pays if p.meta["model_seed"] == model.seed]
        if cases:
            out.update(sglang_routes.replay_cases(ctx, vllm_routes.hf_config(model, head_dim=head_dim), model.seed,
                                                  cases))
    return out


# ------------------------------------------------------------------------------------ the releases' formats
# One request's routes (vLLM 0.24's array: [tokens - 1 - start, num_hidden_layers, K]) in the form
# another vLLM release ships them, as its source defines it (r3bridge/engines/route_formats.py
# names the releases; tests/fixtures/engine_formats/README.md what was read).

def split_v021(routes: np.ndarray, prompt_len: int, moe_layer_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM 0.21's split form as JSON: ``prompt_routed_experts`` (the prompt's rows) and the
    choice's ``routed_experts`` (the generated tokens' rows but the last), int16 lists over the
    MoE layers only."""
    moe = np.asarray(routes)[:, [int(i) for i in moe_layer_ids]].astype(np.int16)
    return {"prompt_routed_experts": moe[:prompt_len].tolist(), "routed_experts": moe[prompt_len:].tolist()}


def npy_base64(routes: np.ndarray) -> str:
    """vLLM's OpenAI serving form of the array: base64 of a ``.npy`` file (shape and dtype in its header)."""
    import base64
    import io

    buf = io.BytesIO()
    np.save(buf, np.asarray(routes), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def auxoutput_emissions(routes: np.ndarray, prompt_len: int, start: int = 0) -> list[dict[str, Any]]:
    """vLLM 0.31+'s AuxOutput rows as the scheduler hands them (``AuxOutputRequestOutput``): the
    prefill step's accepted rows from ``routed_experts_prompt_start`` to the prompt's last token,
    then one row per decode step at ``token_start = tokens - 1``."""
    routes = np.asarray(routes)
    first = max(0, prompt_len - start)
    out = [{"token_start": start, "rows": routes[:first]}]
    out += [{"token_start": start + r, "rows": routes[r:r + 1]} for r in range(first, routes.shape[0])]
    return out


def auxoutput_keys(routes: np.ndarray, block_size: int, namespace: str) -> tuple[list[str], dict[str, bytes]]:
    """vLLM 0.31+'s by-reference form (the Mooncake backend's keys-only output): one store key per
    full KV block of rows, ``vllm-artifact/<namespace>/<block hash hex>``, and the store's objects
    (each block's C-order bytes). The hash here is a stand-in (sha256 of the block's token index
    and rows): vLLM's is the KV block hash, which a reader never recomputes."""
    import hashlib

    routes = np.ascontiguousarray(routes)
    keys, store = [], {}
    for b in range(routes.shape[0] // block_size):
        block = routes[b * block_size:(b + 1) * block_size]
        key = f"vllm-artifact/{namespace}/" + hashlib.sha256(bytes([b % 256]) + block.tobytes()).hexdigest()[:32]
        keys.append(key)
        store[key] = block.tobytes(order="C")
    return keys, store


# ------------------------------------------------------------------------------------ stand-in fixtures
def _routes_of(model: Any, tokens: list[int], moe_layer_ids: Sequence[int], num_layers: int, topk: int,
               num_experts: int) -> np.ndarray:
    """The HF model's top-k per token of one prefill over ``tokens`` in vLLM's layout: rows for
    every token but the last, every hidden layer (dense ones zero), vLLM's dtype."""
    import torch

    from r3bridge.demo.hf_engine import _RouteRecorder

    rec = _RouteRecorder(model, moe_layer_ids)
    try:
        with torch.no_grad():
            model(torch.as_tensor([tokens[:-1]], dtype=torch.int64))
    finally:
        rec.remove()
    out = np.zeros((len(tokens) - 1, num_layers, topk), dtype=route_dtype(num_experts))
    for lid in moe_layer_ids:
        out[:, lid] = rec.calls[lid][0].reshape(len(tokens) - 1, topk).numpy().astype(out.dtype)
    return out


def stand_in_fixtures(out_dir: str) -> list[str]:
    """Write the fixtures the GPU scripts will record (``vllm_smoke.npz``, ``vllm_routes_<case>.npz``:
    same names, same cases, same format), made here in vLLM's exact format from a real HF
    Qwen3-MoE's prefill routes (random token ids; ``meta.recorded`` False, ``engine``
    ``hf-transformers``) until the recorded ones replace them."""
    from r3bridge.demo.hf_engine import build_hf_model
    from r3bridge.hf import ModelInfo
    from testlab.mbridge_spec import tiny_qwen3_moe

    def model_of(num_experts: int, dense: tuple[int, ...], seed: int) -> tuple[Any, dict[str, Any]]:
        cfg = tiny_qwen3_moe(num_layers=4, dense=dense, num_experts=num_experts, topk=4, vocab=64, max_positions=256)
        info = ModelInfo.from_hf_config(cfg)
        facts = {"num_experts": info.num_experts, "num_hidden_layers": info.num_layers, "topk": info.topk,
                 "moe_layer_ids": list(info.moe_layer_ids)}
        return build_hf_model(cfg, seed=seed, router_std=0.5), facts

    g = np.random.default_rng(0)

    def toks(n: int) -> list[int]:
        return g.integers(1, 64, size=n).tolist()

    def payload(model: Any, facts: dict, reqs: list[tuple[list[int], list[int], int]], case: str) -> Payloads:
        routes = [_routes_of(model, p + o, facts["moe_layer_ids"], facts["num_hidden_layers"], facts["topk"],
                             facts["num_experts"])[s:] for p, o, s in reqs]
        return Payloads(routes, [p for p, _, _ in reqs], [o for _, o, _ in reqs],
                        {**facts, "prompt_start": [s for _, _, s in reqs], "case": case, "engine": "hf-transformers",
                         "version": None, "recorded": False})

    written = []
    model_a, facts_a = model_of(32, (), 11)
    smoke = [(toks(n), toks(m), 0) for n, m in zip((9, 24, 17, 40), (12, 20, 7, 16))]
    written.append(save_payloads(os.path.join(out_dir, "vllm_smoke.npz"), payload(model_a, facts_a, smoke, "smoke")))
    base = [(toks(n), toks(m), 0) for n, m in zip((9, 24, 17, 40), (12, 20, 7, 16))]
    written.append(save_payloads(os.path.join(out_dir, "vllm_routes_chunked_prefill.npz"),
                                 payload(model_a, facts_a, base, "chunked_prefill")))
    again = [(base[3][0], toks(10), 0), (base[3][0], toks(10), 0)]
    pay = payload(model_a, facts_a, again, "prefix_cache")
    pay.meta.update(prompt_rows=len(base[3][0]) - 1, num_cached_tokens=[32, 32],
                    prompt_rows_equal_to_first_computation=[len(base[3][0]) - 1] * 2)
    written.append(save_payloads(os.path.join(out_dir, "vllm_routes_prefix_cache.npz"), pay))
    t1, o1 = toks(14), toks(9)
    t2 = t1 + o1 + toks(5)
    start = len(t1) + len(o1) - 1
    written.append(save_payloads(os.path.join(out_dir, "vllm_routes_prompt_start.npz"),
                                 payload(model_a, facts_a, [(t1, o1, 0), (t2, toks(8), start)], "prompt_start")))
    model_b, facts_b = model_of(320, (0,), 12)
    dense = [(toks(n), toks(m), 0) for n, m in zip((11, 30, 19), (10, 14, 6))]
    written.append(save_payloads(os.path.join(out_dir, "vllm_routes_e320_dense_first.npz"),
                                 payload(model_b, facts_b, dense, "e320_dense_first")))
    return written


if __name__ == "__main__":      # python -m testlab.vllm_payloads tests/fixtures/vllm
    import sys

    for p in stand_in_fixtures(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/vllm"):
        print(p, os.path.getsize(p))
