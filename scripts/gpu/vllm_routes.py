"""Routes straight from ``vllm.LLM.generate`` replayed in a megatron-core model (issue 36, item 4).

No framework: real vLLM samples from an HF checkpoint saved here; its ``routed_experts`` go through
``ReplayBatch.from_vllm`` (and ``r3bridge.rollout.stitching.rollout_routes`` for a turn returned from a
prompt-start offset) into the rank targets of a megatron-core model built from the same checkpoint
(``r3bridge.demo.hf_to_mcore``, Transformer Engine layer spec, bf16, one GPU), whose every router
call is checked row by row against an independent packing reference (``RoutingProbe`` and
``tests/megatron/replay_grid.py``, as ``scripts/gpu/mbridge_autobridge.py`` does). Cases:

* ``chunked_prefill``: model A (verl's GPU model: 4 layers, all MoE, 32 experts top-4), prefix
  caching on, ``max_num_batched_tokens=16`` so every prompt longer than 16 tokens is prefilled in
  chunks, CUDA graphs at vLLM's default; four prompts of 9-40 tokens;
* ``prefix_cache``: the same engine, one 40-token prompt already served, sent twice more (the
  full blocks come from the prefix cache: ``num_cached_tokens`` is reported); are the cached
  prompt rows returned, and identical to the first computation's?
* ``prompt_start``: a two-turn sample; turn 2 asks for rows from ``routed_experts_prompt_start``
  (the token turn 1 sampled last), stitched to turn 1's rows;
* ``e320_dense_first``: model B (layer 0 dense, 320 experts top-4): uint16 ids, zero rows on the
  dense layer (vLLM's all-hidden-layers axis), the dense column dropped by ``moe_layer_ids``.

Each case is replayed exactly (0 mismatching rows of N) or refused with a ``ReplayError`` that
says why; either is a result. Native agreement (the trainer's own top-k against the engine's
routes, same weights) is reported per case. Every case's raw payload is saved as
``$OUT/vllm_routes_<case>.npz`` (``testlab.vllm_payloads``: the CPU tests' fixture format), the
summary as ``$OUT/vllm_routes.json``. Exit 0 when every case is exact or refused; 1 otherwise.

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site-vllm:$PWD python scripts/gpu/vllm_routes.py --out $OUT

Needs the TE set (megatron-core 0.16.1 + Transformer Engine) and the vLLM set. Carry: here
``bash scripts/gpu/bundle.sh prepare .dev/b base te ray verl vllm`` (13 parts; check the import closure
first with ``scripts/gpu/closure_static.py``); on the device ``bundle.sh stash .dev/b/qI`` per part but
the last, then in the call carrying the last part, back to back (the machine keeps ~/stash only while warm):
``bundle.sh install .dev/b/q12 && export PYTHONPATH=$(bash scripts/gpu/bundle.sh pythonpath vllm):$PWD
VLLM_USE_FLASHINFER_SAMPLER=0 && timeout 240 python scripts/gpu/vllm_smoke.py --out $OUT/vllm;
timeout 300 python scripts/gpu/vllm_routes.py --out $OUT/vllm``. Then, here, copy the ``.npz`` files into
``tests/fixtures/vllm/`` and run ``tests/engine/test_vllm_payloads.py``. Results:
docs/gpu-results/vllm_h100_2026-11-27/.
SGLang's counterpart is ``scripts/gpu/sglang_routes.py`` (SGLang 0.5.12 ran on the device, 2026-11-29).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.abspath(os.path.join(_HERE, "..", ".."))
for _p in (_ROOT, os.path.join(_ROOT, "tests", "megatron"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ROUTER_STD = 0.5      # router weights with clear top-k margins (a random init ties them: field notes 14)


@dataclass(frozen=True)
class ModelCase:
    name: str
    num_experts: int
    topk: int
    dense: tuple[int, ...]
    num_layers: int = 4
    seed: int = 11
    engine: dict[str, Any] = field(default_factory=dict)   # extra vllm.LLM arguments


MODEL_A = ModelCase("A", num_experts=32, topk=4, dense=(), engine=dict(
    enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=16))
MODEL_B = ModelCase("B", num_experts=320, topk=4, dense=(0,), seed=12, engine=dict(enforce_eager=True))


def hf_config(m: ModelCase, head_dim: Optional[int] = None) -> Any:
    """``head_dim``: None takes ``tiny_qwen3_moe``'s (8, or ``R3E2E_HEAD_DIM``: vLLM 0.26.0 ran with 64)."""
    from testlab.mbridge_spec import tiny_qwen3_moe

    return tiny_qwen3_moe(num_layers=m.num_layers, dense=m.dense, num_experts=m.num_experts, topk=m.topk,
                          vocab=64, max_positions=256, head_dim=head_dim)


def write_checkpoint(path: str, m: ModelCase) -> tuple[Any, dict]:
    """The HF model's config + safetensors (no tokenizer: the engine runs on token ids) and its
    fp32 state (the trainer's weights)."""
    from r3bridge.demo.hf_engine import build_hf_model

    cfg = hf_config(m)
    model = build_hf_model(cfg, seed=m.seed, router_std=ROUTER_STD)
    model.save_pretrained(path, safe_serialization=True)
    return cfg, {k: v.detach().clone() for k, v in model.state_dict().items()}


def prompts(vocab: int, lens: tuple[int, ...], seed: int) -> list[list[int]]:
    import numpy as np

    g = np.random.default_rng(seed)
    return [g.integers(1, vocab, size=n).tolist() for n in lens]


@dataclass
class Case:
    """One case: what the engine returned and how it reaches the trainer."""
    name: str
    model: ModelCase
    tokens: list[list[int]]                     # each sample's full sequence (what the trainer sees)
    calls: list[list[Any]]                      # per sample, its engine calls' routed_experts
    starts: list[list[int]]                     # per sample, each call's routed_experts_prompt_start
    payloads: Any = None                        # testlab.vllm_payloads.Payloads of every call
    facts: dict[str, Any] = field(default_factory=dict)
    engine_version: Optional[str] = None        # the vLLM release that returned them (its decoder reads them)

    def replay_batch(self, facts: dict[str, Any]) -> Any:
        """The rollout's routes as r3bridge ingests them: one call per sample through
        ``ReplayBatch.from_vllm``; several (offset turns) through ``ingest.rollout_routes``."""
        from r3bridge.batch.schema import ReplayBatch
        from r3bridge.rollout.stitching import rollout_routes

        if all(len(c) == 1 and s == [0] for c, s in zip(self.calls, self.starts)):
            return ReplayBatch.from_vllm([c[0] for c in self.calls], num_experts=facts["num_experts"],
                                         moe_layer_ids=facts["moe_layer_ids"], engine_version=self.engine_version)
        return rollout_routes(self.calls, num_experts=facts["num_experts"], moe_layer_ids=facts["moe_layer_ids"],
                              start_rows=self.starts)


def _payloads(reqs: list[list[int]], outs: list[Any], facts: dict[str, Any], starts: list[int], case: str) -> Any:
    from testlab.vllm_payloads import Payloads

    return Payloads([o.outputs[0].routed_experts for o in outs], [list(p) for p in reqs],
                    [list(o.outputs[0].token_ids) for o in outs],
                    {**facts, "prompt_start": list(starts), "case": case, "engine": "vllm", "recorded": True,
                     "num_cached_tokens": [getattr(o, "num_cached_tokens", None) for o in outs]})


# ------------------------------------------------------------------------------------ engine side
def _shutdown(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort; the GPU memory check below decides
        print(f"engine shutdown: {type(e).__name__}: {e}", file=sys.stderr)
    del llm
    gc.collect()


def _facts(cfg: Any) -> dict[str, Any]:
    from vllm_smoke import model_facts

    return model_facts(cfg)


def generate_cases(args: argparse.Namespace, res: dict[str, Any], engine_extra: Optional[dict[str, Any]] = None,
                   ) -> tuple[list[Case], dict[str, tuple[Any, dict]]]:
    """The cases' engine calls; ``engine_extra``: more ``vllm.LLM`` arguments for both engines
    (``vllm026_routes.py --no-async-scheduling``)."""
    from vllm import LLM, SamplingParams
    from vllm_smoke import llm_kwargs

    cases: list[Case] = []
    models: dict[str, tuple[Any, dict]] = {}
    # ---- model A: chunked prefill, prefix cache, prompt start
    path = os.path.join(args.work, "model_A")
    cfg, state = write_checkpoint(path, MODEL_A)
    models["A"] = (cfg, state)
    facts = _facts(cfg)
    t = time.monotonic()
    llm = LLM(**llm_kwargs(path, args.gpu_mem, skip_tokenizer_init=True, **MODEL_A.engine, **(engine_extra or {})))
    res["engine_A_start_s"] = round(time.monotonic() - t, 1)
    print(f"vllm_routes: engine A up in {res['engine_A_start_s']} s", flush=True)

    def gen(reqs: list[list[int]], max_tokens: list[int], seeds: list[int], starts: Optional[list[int]] = None):
        starts = starts or [0] * len(reqs)
        params = [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True, detokenize=False,
                                 routed_experts_prompt_start=st)
                  for n, s, st in zip(max_tokens, seeds, starts)]
        return llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)

    reqs = prompts(64, (9, 24, 17, 40), seed=1)
    outs = gen(reqs, [12, 20, 7, 16], [1, 2, 3, 4])
    print("vllm_routes: chunked_prefill generated", flush=True)
    pay = _payloads(reqs, outs, facts, [0] * 4, "chunked_prefill")
    cases.append(Case("chunked_prefill", MODEL_A, [p + list(o.outputs[0].token_ids) for p, o in zip(reqs, outs)],
                      [[r] for r in pay.routes], [[0]] * 4, pay, facts))
    # the same 40-token prompt twice more: its full KV blocks come from the prefix cache
    again = [reqs[3], reqs[3]]
    outs2 = gen(again, [10, 10], [5, 6])
    pay2 = _payloads(again, outs2, facts, [0, 0], "prefix_cache")
    first_prompt_rows = pay.routes[3][: len(reqs[3]) - 1] if pay.routes[3] is not None else None
    cached = []
    for r in pay2.routes:
        if r is None or first_prompt_rows is None:
            cached.append(None)
            continue
        n = len(reqs[3]) - 1
        cached.append(int((r[:n] == first_prompt_rows).all(axis=(1, 2)).sum()))
    pay2.meta["prompt_rows_equal_to_first_computation"] = cached
    pay2.meta["prompt_rows"] = len(reqs[3]) - 1
    cases.append(Case("prefix_cache", MODEL_A, [p + list(o.outputs[0].token_ids) for p, o in zip(again, outs2)],
                      [[r] for r in pay2.routes], [[0], [0]], pay2, facts))
    # two turns; turn 2 returns rows from the token turn 1 sampled last (its first unreturned row)
    t1 = prompts(64, (14,), seed=7)[0]
    o1 = gen([t1], [9], [7])[0]
    turn1 = t1 + list(o1.outputs[0].token_ids)
    obs = prompts(64, (5,), seed=8)[0]
    t2 = turn1 + obs
    start = len(turn1) - 1
    o2 = gen([t2], [8], [8], starts=[start])[0]
    pay3 = _payloads([t1, t2], [o1, o2], facts, [0, start], "prompt_start")
    cases.append(Case("prompt_start", MODEL_A, [t2 + list(o2.outputs[0].token_ids)],
                      [[o1.outputs[0].routed_experts, o2.outputs[0].routed_experts]], [[0, start]], pay3, facts))
    _shutdown(llm)
    # ---- model B: > 256 experts (uint16), dense first layer
    path = os.path.join(args.work, "model_B")
    cfg, state = write_checkpoint(path, MODEL_B)
    models["B"] = (cfg, state)
    facts = _facts(cfg)
    t = time.monotonic()
    llm = LLM(**llm_kwargs(path, args.gpu_mem, skip_tokenizer_init=True, **MODEL_B.engine, **(engine_extra or {})))
    res["engine_B_start_s"] = round(time.monotonic() - t, 1)
    reqs = prompts(64, (11, 30, 19), seed=3)
    outs = gen(reqs, [10, 14, 6], [9, 10, 11])
    pay = _payloads(reqs, outs, facts, [0] * 3, "e320_dense_first")
    cases.append(Case("e320_dense_first", MODEL_B, [p + list(o.outputs[0].token_ids) for p, o in zip(reqs, outs)],
                      [[r] for r in pay.routes], [[0]] * 3, pay, facts))
    _shutdown(llm)
    return cases, models


# ------------------------------------------------------------------------------------ trainer side
def _init_megatron() -> Any:
    import torch

    from r3bridge.testing.harness.dist import Layout, _init_layout

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    return _init_layout(Layout(), 0, 1, seed=0)


def build_trainer(cfg: Any, state: dict, ctx: Any) -> list:
    import torch

    from r3bridge.demo.hf_to_mcore import hf_to_mcore, spec_from_hf, to_te_names
    from r3bridge.testing.harness.models import build_model_chunks, load_reference_state

    spec = spec_from_hf(cfg, attention="real")
    spec = dataclasses.replace(spec, layer_spec="te", extra_config={
        **spec.extra_config, "bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16})
    chunks = build_model_chunks(spec, ctx)
    load_reference_state(chunks, to_te_names(hf_to_mcore(state, cfg, attention="real")), ctx)
    return [c.to("cuda", dtype=torch.bfloat16) for c in chunks]


def replay_case(case: Case, chunks: list, rep: Any, ctx: Any, out: dict[str, Any], device: str = "cuda",
                thd: bool = True) -> None:
    """Native pass (agreement reported) and R3 forward-only pass (every router row checked).
    ``thd``: packed sequences (TE attention); ``False`` for megatron-core's local attention (the CPU),
    which takes no packed-sequence parameters."""
    from replay_grid import _check_probe, _install_step

    from r3bridge.demo.hf_to_mcore import packed_from_tokens
    from r3bridge.errors import ReplayError
    from r3bridge.testing.harness.data import batch_to
    from r3bridge.testing.harness.probe import RoutingProbe
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    try:
        routes = case.replay_batch(case.facts)
    except ReplayError as e:
        out.update(result="refused", refusal=f"{type(e).__name__}: {e}")
        return
    out["rows"] = routes.total_rows
    cpu_batch = packed_from_tokens(case.tokens, align=1)
    batch = batch_to(cpu_batch, device)
    ids = {id(batch): list(range(len(case.tokens)))}
    layers = list(rep.layer_ids)
    out["replayer_layers"] = layers
    fwd = make_forward_step(ctx, thd=thd)

    def checked(action: str, route_kind: Optional[str], route_map: dict) -> tuple[dict, list[str]]:
        for c in chunks:
            c.eval()
        counts: dict[str, int] = {}
        with RoutingProbe(chunks, include_mtp=False) as probe:
            with rep.open_pass(action, forward_only=True, route_kind=route_kind) as st:
                run_schedule(chunks, [batch], _install_step(st, fwd, route_map, ids), forward_only=True)
        errs = _check_probe(probe, [cpu_batch], [routes], ctx, False, False, layers, counts)
        return counts, errs

    try:
        nat, _ = checked("native", None, {})
        r3, errs = checked("replay", "rollout", {id(batch): routes})
    except ReplayError as e:
        out.update(result="refused", refusal=f"{type(e).__name__}: {e}")
        return
    out["native_agreement"] = round(1 - nat["mismatching_rows"] / max(1, nat["rows"]), 4)
    out["native_rows"] = nat["rows"]
    out.update(r3_calls=r3["calls"], r3_rows=r3["rows"], r3_mismatching_rows=r3["mismatching_rows"],
               errors=errs[:10])
    out["result"] = "exact" if r3["rows"] > 0 and r3["mismatching_rows"] == 0 and not errs else "mismatch"


def summarize(cases: dict[str, dict[str, Any]]) -> bool:
    """Pass: every case replayed exactly or refused with a ReplayError (a reason given)."""
    return bool(cases) and all(c.get("result") in ("exact", "refused") and not c.get("format_problems")
                               for c in cases.values())


def run(args: argparse.Namespace, res: dict[str, Any]) -> None:
    from vllm_smoke import environment

    from r3bridge.megatron import Replayer
    from testlab.vllm_payloads import save_payloads

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")    # not carried (vllm_smoke.set_environment)
    res["environment"] = environment()
    cases, models = generate_cases(args, res)
    per: dict[str, dict[str, Any]] = res.setdefault("cases", {})
    for case in cases:
        save_payloads(os.path.join(args.out, f"vllm_routes_{case.name}.npz"), case.payloads)
        probs = case.payloads.problems()
        per[case.name] = {"model": case.model.name, "samples": len(case.tokens),
                          "dtype": str(next((r.dtype for r in case.payloads.routes if r is not None), None)),
                          "format_problems": probs,
                          **{k: case.payloads.meta[k] for k in ("num_cached_tokens", "prompt_rows",
                                                                "prompt_rows_equal_to_first_computation")
                             if k in case.payloads.meta}}
    ctx = _init_megatron()
    for name in ("A", "B"):
        cfg, state = models[name]
        chunks = build_trainer(cfg, state, ctx)
        rep = Replayer(chunks)        # one per model: it attaches r3bridge's hook to every router
        for case in (c for c in cases if c.model.name == name):
            replay_case(case, chunks, rep, ctx, per[case.name])
        del chunks, rep
        gc.collect()
    res["pass"] = summarize(per)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/vllm"))
    ap.add_argument("--work", default="/tmp/r3b-vllm-routes")
    ap.add_argument("--gpu-mem", type=float, default=0.15)
    ap.add_argument("--engine", choices=("vllm",), default="vllm",
                    help="vllm only; SGLang: scripts/gpu/sglang_routes.py")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    res: dict[str, Any] = {"pass": False}
    t0 = time.monotonic()
    try:
        run(args, res)
    except Exception as e:  # noqa: BLE001 - reported, exit 1
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        print(res["traceback"], file=sys.stderr)
    res["seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(args.out, "vllm_routes.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({"pass": res.get("pass"), "seconds": res["seconds"], "error": res.get("error"),
                      "cases": {k: {kk: v.get(kk) for kk in ("result", "r3_rows", "r3_mismatching_rows",
                                                             "native_agreement", "refusal", "format_problems",
                                                             "num_cached_tokens",
                                                             "prompt_rows_equal_to_first_computation")}
                                for k, v in res.get("cases", {}).items()}}, default=str))
    return 0 if res.get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
