"""Routes straight from ``sglang.Engine.generate`` (SGLang 0.5.12, verl 0.9.1's pin) on one GPU,
recorded as CPU fixtures and checked against the HF model's own routing (issue 46, item 1).

No framework: a tiny Qwen3-MoE saved here from its config (random weights, no hub, no tokenizer:
the engine runs on token ids with ``skip_tokenizer_init``) is served by SGLang with
``enable_return_routed_experts``; each response's ``meta_info`` is saved as SGLang returned it
(``$OUT/sglang_routes_<case>.json``: ``testlab.sglang_payloads`` reads it), checked against SGLang's
format (``sglang_format_problems``), decoded by r3bridge (``ReplayBatch.from_sglang(...,
engine_version=<installed>)``) and compared with the top-k the HF model (fp32, same weights) computes
for the same tokens. Cases:

* ``chunked_prefill`` (model A: 4 layers, all MoE, 32 experts top-4; ``chunked_prefill_size=16``):
  four prompts of 9-40 tokens;
* ``radix_cache``: model A's 40-token prompt sent twice more (the radix cache serves its prefix:
  ``cached_tokens`` in meta_info); are the cached prompt rows returned, equal to the first computation?
* ``prompt_start``: a two-turn sample, turn 2 with ``routed_experts_start_len`` at the token turn 1
  sampled last;
* ``e320_dense_middle`` (model B: 320 experts top-4, layer 2 dense via ``mlp_only_layers``): int32
  ids above 255, the dense layer's column. SGLang 0.5.12's ``Qwen3MoeDecoderLayer`` marks every
  layer sparse (``models/qwen3_moe.py``: "all layers are sparse"), so what it does with a dense
  layer is recorded as it happens (an error, or routes on the dense layer).

Summary: ``$OUT/sglang_routes.json``; exit 0 when SGLang ran every case (whatever it returned is
the result), 1 when it could not start (the error text is the result).

    PYTHONPATH=/tmp/site-sglang:$PWD python scripts/gpu/sglang_routes.py --out $OUT
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.abspath(os.path.join(_HERE, "..", ".."))
for _p in (_ROOT, os.path.join(_ROOT, "tests", "megatron"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ROUTER_STD = 0.5      # clear top-k margins (field notes 14), as scripts/gpu/vllm_routes.py


def hf_config(num_experts: int, dense: tuple[int, ...]) -> Any:
    from testlab.mbridge_spec import tiny_qwen3_moe

    return tiny_qwen3_moe(num_layers=4, dense=dense, num_experts=num_experts, topk=4, vocab=64, max_positions=256,
                          head_dim=64)


def build_reference(cfg: Any, seed: int) -> Any:
    """The HF model (fp32) whose weights the engine serves: drawn from (seed, parameter name) only,
    so the CPU tests rebuild the very same model (tests/engine/test_sglang_payloads.py)."""
    from r3bridge.demo.hf_engine import build_hf_model

    return build_hf_model(cfg, seed=seed, router_std=ROUTER_STD)


def write_checkpoint(path: str, cfg: Any, seed: int) -> Any:
    """The checkpoint SGLang serves (bf16 safetensors + config, no tokenizer); returns the fp32 reference."""
    import torch

    build_reference(cfg, seed).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return build_reference(cfg, seed)


def facts_of(cfg: Any) -> dict[str, Any]:
    from r3bridge.hf import ModelInfo

    info = ModelInfo.from_hf_config(cfg)
    return {"num_experts": info.num_experts, "num_hidden_layers": info.num_layers, "topk": info.topk,
            "moe_layer_ids": list(info.moe_layer_ids)}


def prompts(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    import numpy as np

    g = np.random.default_rng(seed)
    return [g.integers(2, 64, size=n).tolist() for n in lens]


def hf_routes(model: Any, tokens: list[int], moe: list[int]) -> Any:
    """The HF model's top-k ``[len(tokens) - 1, len(moe), K]`` (rows for every token but the last)."""
    import torch

    from r3bridge.demo.hf_engine import _RouteRecorder

    rec = _RouteRecorder(model, moe)
    try:
        with torch.no_grad():
            model(torch.as_tensor([tokens[:-1]], dtype=torch.int64, device=next(model.parameters()).device))
    finally:
        rec.remove()
    return torch.stack([rec.calls[i][0].reshape(len(tokens) - 1, -1) for i in moe], dim=1).numpy()


def engine(path: str, args: argparse.Namespace, **extra: Any) -> Any:
    import sglang as sgl

    kw = dict(model_path=path, skip_tokenizer_init=True, enable_return_routed_experts=True,
              attention_backend=args.attention_backend, sampling_backend="pytorch", disable_cuda_graph=True,
              mem_fraction_static=args.mem, log_level="error", random_seed=0)
    kw.update(extra)
    return sgl.Engine(**kw)


def generate(llm: Any, reqs: list[list[int]], max_new: list[int], seeds: list[int], start: int = 0) -> list[dict]:
    params = [{"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": s}
              for n, s in zip(max_new, seeds)]
    out = llm.generate(input_ids=reqs, sampling_params=params, return_routed_experts=True,
                       routed_experts_start_len=start)
    return out if isinstance(out, list) else [out]


def check_case(name: str, reqs: list[list[int]], outs: list[dict], starts: list[int], facts: dict, ref: Any,
               version: str, res: dict) -> dict:
    """Format, r3bridge's decode and the HF model's routing for one case's responses."""
    import numpy as np

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.errors import ReplayError
    from testlab.sglang_payloads import sglang_format_problems

    case: dict[str, Any] = {"requests": len(reqs)}
    metas = [o["meta_info"] for o in outs]
    case["cached_tokens"] = [m.get("cached_tokens") for m in metas]
    case["format_problems"] = [f"request {i}: {p}" for i, m in enumerate(metas)
                               for p in sglang_format_problems(m, num_hidden_layers=facts["num_hidden_layers"],
                                                               topk=facts["topk"], num_experts=facts["num_experts"],
                                                               moe_layer_ids=facts["moe_layer_ids"], start=starts[i])]
    payload = {"engine": "sglang", "version": version, "case": name, "recorded": True, **facts,
               "prompt_start": starts, "prompts": reqs, "outputs": [list(o["output_ids"]) for o in outs],
               "meta_info": [{k: v for k, v in m.items() if k in ("prompt_tokens", "completion_tokens", "cached_tokens",
                                                                  "routed_experts", "routed_experts_dtype")}
                             for m in metas]}
    with open(os.path.join(res["out"], f"sglang_routes_{name}.json"), "w") as f:
        json.dump(payload, f, default=int)
    try:
        batch = ReplayBatch.from_sglang(payload["meta_info"], num_experts=facts["num_experts"],
                                        num_layers=facts["num_hidden_layers"], topk=facts["topk"],
                                        moe_layer_ids=facts["moe_layer_ids"], start_rows=starts,
                                        engine_version=version)
    except ReplayError as e:
        case["decode"] = f"refused: {type(e).__name__}: {e}"
        return case
    case["decode"] = "ok"
    case["rows"] = batch.total_rows
    agree = total = 0
    per_layer = np.zeros(len(facts["moe_layer_ids"]))
    for i, (p, o) in enumerate(zip(reqs, outs)):
        toks = list(p) + list(o["output_ids"])
        want = hf_routes(ref, toks, facts["moe_layer_ids"])[starts[i]:]
        got = batch.routes[int(batch.offsets[i]):int(batch.offsets[i + 1])].numpy().astype(np.int64)
        if got.shape != want.shape:
            case.setdefault("shape_mismatch", []).append([list(got.shape), list(want.shape)])
            continue
        eq = (np.sort(got, -1) == np.sort(want, -1)).all(-1)          # [rows, layers]
        agree += int(eq.sum())
        total += eq.size
        per_layer += eq.sum(0)
    case["hf_agreement"] = round(agree / total, 4) if total else None
    case["hf_agreement_per_layer"] = [round(x / (total / len(per_layer)), 4) for x in per_layer] if total else None
    return case


def run(args: argparse.Namespace, res: dict) -> None:
    import importlib.metadata

    import torch

    version = importlib.metadata.version("sglang")
    res["environment"] = {"sglang": version, "torch": torch.__version__,
                          "transformers": importlib.metadata.version("transformers"),
                          "gpu": torch.cuda.get_device_name(0)}
    cases = res.setdefault("cases", {})
    # ---- model A
    cfg = hf_config(32, ())
    path = os.path.join(args.work, "model_A")
    ref = write_checkpoint(path, cfg, seed=11).to("cuda")
    facts = facts_of(cfg)
    t = time.monotonic()
    llm = engine(path, args, chunked_prefill_size=16)
    res["engine_A_start_s"] = round(time.monotonic() - t, 1)
    reqs = prompts((9, 24, 17, 40), seed=1)
    outs = generate(llm, reqs, [12, 20, 7, 16], [1, 2, 3, 4])
    cases["chunked_prefill"] = check_case("chunked_prefill", reqs, outs, [0] * 4, facts, ref, version, res)
    again = [reqs[3], reqs[3]]
    outs2 = generate(llm, again, [10, 10], [5, 6])
    c = check_case("radix_cache", again, outs2, [0, 0], facts, ref, version, res)
    import base64

    import numpy as np

    n = len(reqs[3]) - 1
    first = np.frombuffer(base64.b64decode(outs[3]["meta_info"]["routed_experts"]), "<i4").reshape(
        -1, facts["num_hidden_layers"], facts["topk"])[:n]
    c["prompt_rows"] = n
    c["prompt_rows_equal_to_first_computation"] = [
        int((np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), "<i4").reshape(
            -1, facts["num_hidden_layers"], facts["topk"])[:n] == first).all(axis=(1, 2)).sum()) for o in outs2]
    cases["radix_cache"] = c
    t1 = prompts((14,), seed=7)[0]
    o1 = generate(llm, [t1], [9], [7])[0]
    turn1 = t1 + list(o1["output_ids"])
    t2 = turn1 + prompts((5,), seed=8)[0]
    start = len(turn1) - 1
    o2 = generate(llm, [t2], [8], [8], start=start)[0]
    cases["prompt_start"] = check_case("prompt_start", [t1, t2], [o1, o2], [0, start], facts, ref, version, res)
    llm.shutdown()
    del llm, ref
    gc.collect()
    torch.cuda.empty_cache()
    # ---- model B: 320 experts, layer 2 dense (mlp_only_layers)
    cfg = hf_config(320, (2,))
    path = os.path.join(args.work, "model_B")
    ref = write_checkpoint(path, cfg, seed=12).to("cuda")
    facts = facts_of(cfg)
    try:
        t = time.monotonic()
        llm = engine(path, args)
        res["engine_B_start_s"] = round(time.monotonic() - t, 1)
        reqs = prompts((11, 30, 19), seed=3)
        outs = generate(llm, reqs, [10, 14, 6], [9, 10, 11])
        c = check_case("e320_dense_middle", reqs, outs, [0] * 3, facts, ref, version, res)
        raw = np.frombuffer(base64.b64decode(outs[0]["meta_info"]["routed_experts"]), "<i4").reshape(
            -1, facts["num_hidden_layers"], facts["topk"])
        c["dense_layer_2_nonzero_rows"] = int(raw[:, 2].any(-1).sum())
        c["max_id"] = int(raw.max())
        cases["e320_dense_middle"] = c
        llm.shutdown()
    except Exception as e:  # noqa: BLE001 - what SGLang does with a dense layer is the result
        cases["e320_dense_middle"] = {"engine_error": f"{type(e).__name__}: {e}"[:2000]}


# ------------------------------------------------------------------------------------ trainer side
class RecordedCase:
    """A recorded case (``$OUT/sglang_routes_<case>.json``) as ``vllm_routes.replay_case`` takes it:
    each sample's full tokens and its routes through ``ReplayBatch.from_sglang`` (turns that start
    later stitched after the turn before)."""

    def __init__(self, payload: dict) -> None:
        self.payload = payload
        self.name = payload["case"]
        p = payload
        if p["case"] == "prompt_start":          # one sample, two turns
            self.tokens = [p["prompts"][1] + p["outputs"][1]]
        else:
            self.tokens = [q + o for q, o in zip(p["prompts"], p["outputs"])]
        self.facts = {k: p[k] for k in ("num_experts", "num_hidden_layers", "topk", "moe_layer_ids")}

    def replay_batch(self, facts: dict) -> Any:
        from r3bridge.batch.schema import ReplayBatch
        from r3bridge.engines.route_formats import decode_engine_routes
        from r3bridge.rollout.stitching import rollout_routes

        p = self.payload
        if p["case"] != "prompt_start":
            return ReplayBatch.from_sglang(p["meta_info"], num_experts=facts["num_experts"],
                                           num_layers=facts["num_hidden_layers"], topk=facts["topk"],
                                           moe_layer_ids=facts["moe_layer_ids"], start_rows=p["prompt_start"],
                                           engine_version=p["version"])
        turns = [decode_engine_routes("sglang", m, version=p["version"], seq=0, start_row=s,
                                      num_hidden_layers=facts["num_hidden_layers"], topk=facts["topk"]).routes
                 for m, s in zip(p["meta_info"], p["prompt_start"])]
        return rollout_routes([turns], num_experts=facts["num_experts"], moe_layer_ids=facts["moe_layer_ids"],
                              start_rows=[p["prompt_start"]])


def replay_rank(ctx: Any, payloads: list[dict], seed: int) -> dict[str, dict]:
    """In a rank of ``r3bridge.testing.harness.dist.spawn_layouts``: every recorded SGLang case of
    one model replayed in the megatron-core model converted from the HF model the engine served
    (:func:`replay_cases`)."""
    facts = {k: payloads[0][k] for k in ("num_experts", "num_hidden_layers", "topk", "moe_layer_ids")}
    dense = tuple(i for i in range(facts["num_hidden_layers"]) if i not in facts["moe_layer_ids"])
    return replay_cases(ctx, hf_config(facts["num_experts"], dense), seed, [RecordedCase(p) for p in payloads])


def replay_cases(ctx: Any, cfg: Any, seed: int, cases: list[Any]) -> dict[str, dict]:
    """The megatron-core model converted from the HF model ``(cfg, seed)`` an engine served (local
    spec, fp32, the rank's device), every case (``.name``, ``.tokens``, ``.facts``,
    ``.replay_batch``) replayed under R3 with every router row checked against the engine's routes
    (``vllm_routes.replay_case``: a native pass for agreement, then an R3 forward)."""
    import dataclasses

    import torch
    from vllm_routes import replay_case

    from r3bridge.demo.hf_to_mcore import hf_to_mcore, spec_from_hf
    from r3bridge.megatron import Replayer
    from r3bridge.testing.harness.models import build_model_chunks, load_reference_state

    state = {k: v.detach().clone() for k, v in build_reference(cfg, seed).state_dict().items()}
    spec = spec_from_hf(cfg, attention="real")
    spec = dataclasses.replace(spec, extra_config={**spec.extra_config, "params_dtype": torch.float32})
    chunks = build_model_chunks(spec, ctx)
    load_reference_state(chunks, hf_to_mcore(state, cfg, attention="real"), ctx)
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    chunks = [c.to(device) for c in chunks]
    rep = Replayer(chunks)
    out: dict[str, dict] = {}
    for case in cases:
        out[case.name] = {}
        replay_case(case, chunks, rep, ctx, out[case.name], device=device, thd=False)
    return out


def replay_main(args: argparse.Namespace) -> int:
    """``--replay DIR``: model A's recorded cases replayed on the GPU; ``$OUT/sglang_replay.json``."""
    import torch

    from r3bridge.testing.harness.dist import Layout, spawn_layouts
    from testlab.sglang_payloads import replay_recorded_rank

    paths = [os.path.join(args.replay, f"sglang_routes_{c}.json") for c in ("chunked_prefill", "radix_cache",
                                                                         "prompt_start")]
    gpu = torch.cuda.is_available()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__}
    t0 = time.monotonic()
    try:
        [[res["cases"]]] = spawn_layouts(replay_recorded_rank, world_size=1, layouts=[Layout()], args=(paths, 11),
                                         timeout=400, backend="nccl" if gpu else "gloo")
    except Exception as e:  # noqa: BLE001 - reported, exit 1
        res["error"] = f"{type(e).__name__}: {e}"[-4000:]
    res["seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(args.out, "sglang_replay.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str)[-6000:])
    ok = "cases" in res and all(c.get("result") == "exact" for c in res["cases"].values())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/sglang"))
    ap.add_argument("--work", default="/tmp/r3b-sglang-routes")
    ap.add_argument("--mem", type=float, default=0.2)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--replay", metavar="DIR", help="no engine: replay model A's recorded cases in DIR "
                    "(sglang_routes_<case>.json) in megatron-core on this machine's GPU (one NCCL rank)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    if args.replay:
        return replay_main(args)
    res: dict[str, Any] = {"ran": False, "out": args.out}
    t0 = time.monotonic()
    try:
        run(args, res)
        res["ran"] = True
    except Exception as e:  # noqa: BLE001 - reported, exit 1
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-6000:]
        print(res["traceback"], file=sys.stderr)
    res["seconds"] = round(time.monotonic() - t0, 1)
    res.pop("out")
    with open(os.path.join(args.out, "sglang_routes.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({k: res.get(k) for k in ("ran", "seconds", "error", "environment", "engine_A_start_s",
                                              "engine_B_start_s", "cases")}, default=str))
    return 0 if res["ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
