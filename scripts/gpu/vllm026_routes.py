"""vLLM 0.26.0 on one GPU: ``vllm_routes.py``'s direct cases and speculative decoding, each request's
routes checked row by row and recorded as CPU fixtures (issue 46, item 2).

Engine side only, as ``scripts/gpu/sglang_routes.py``: no megatron-core, TE, ray or verl on the
device (the replay in megatron-core runs on the CPU from the recorded payloads:
``tests/engine/test_vllm026_checks.py``). Everything goes through vLLM 0.26.0's own
``LLM.generate`` with ``enable_return_routed_experts`` on tiny Qwen3-MoE checkpoints saved here
(random weights drawn from (seed, parameter name), no hub, no tokenizer: ``skip_tokenizer_init``).

* The direct cases of ``vllm_routes.py`` (``vllm_routes.generate_cases``, unchanged): chunked
  prefill, prefix-cache hits, a prompt start offset (model A: 4 MoE layers, 32 experts top-4), 320
  experts with a dense first layer (model B). Each payload is checked against vLLM's format
  (``testlab.vllm_payloads.vllm_format_problems``), decoded through r3bridge's 0.22-0.30 decoder
  (``ReplayBatch.from_vllm(..., engine_version=<installed>)``) and compared with the top-k the HF
  model (fp32, same weights) computes for the same tokens.
* Speculative decoding (vLLM #48622: before 0.26.0 the draft's forward wrote its own layer 0 into
  the routes capture): model A served three times with the same settings (eager, no prefix cache,
  greedy): ``reference`` (no speculation), ``spec_ngram`` (prompt lookup, no draft model) and
  ``spec_draft`` (``method="draft_model"``: a one-layer Qwen3-MoE draft whose MoE layer 0 is what
  #48622 wrote over the target's layer 0). The prompts repeat a pattern so the n-gram proposer
  proposes. Each speculative run's routes are compared row by row with the reference's routes of
  the same tokens and with the HF model's (per layer, prompt rows and generated rows apart), and
  ``r3bridge.metrics.agreement_canaries`` is asked about both; vLLM's own speculative-decoding
  counters (drafts, draft tokens, accepted tokens) say speculation really ran.

Summary ``$OUT/vllm026_routes.json`` (``_direct`` / ``_spec`` with ``--direct-only`` / ``--spec-only``); payloads ``$OUT/vllm026_<case>.npz`` (``testlab.vllm_payloads``;
the CPU fixtures ``tests/fixtures/vllm026/``). Exit 0 when every engine ran (what it returned is the
result), 1 when one could not start (the error is the result).

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site-vllm026:$PWD python scripts/gpu/vllm026_routes.py --out $OUT

``--variant`` picks the engine settings (``VARIANTS``: in-process engine core, routes off, a small KV
pool, the attention backend, the heads' width) and ``--probe`` runs one engine and one ``generate``
only, dumping every thread's stack if it does not return: ``vllm026_device.sh variants`` probes them
in order after 0.26.0's ``generate`` never returned with vLLM's defaults, then runs everything with
the first that returned routes (never a diagnosis-only variant: ``PROBE_ONLY``). ``inproc_hd64``
(model A's heads 64 wide) is the one that ran (2026-11-29, docs/gpu-results/vllm-0.26.0): with heads
of 8, 0.26.0's FlashAttention call never returns.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.abspath(os.path.join(_HERE, "..", ".."))
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One line per step on stdout (flushed): the first device run (2026-11-29) printed nothing
    between the engine's start and the command's timeout, so where it stopped was unknown."""
    print(f"[vllm026 {time.monotonic() - _T0:7.1f} s] {msg}", flush=True)


SPEC_TOKENS = 3                        # draft tokens per step
DRAFT_SEED = 21
NGRAM = {"method": "ngram", "num_speculative_tokens": SPEC_TOKENS, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SPEC_ENGINE = dict(enforce_eager=True, enable_prefix_caching=False, max_num_seqs=8, disable_log_stats=False)


def draft_config() -> Any:
    """The draft model: one MoE layer (32 experts top-4), the target's vocabulary."""
    from testlab.mbridge_spec import tiny_qwen3_moe

    return tiny_qwen3_moe(num_layers=1, dense=(), num_experts=32, topk=4, vocab=64, max_positions=256)


def spec_prompts() -> list[list[int]]:
    """Prompts that repeat a pattern (the n-gram proposer finds its continuation in the prompt)."""
    import numpy as np

    g = np.random.default_rng(5)
    out = []
    for n, reps in ((6, 4), (5, 5), (8, 3), (4, 6)):
        pat = g.integers(2, 64, size=n).tolist()
        out.append(g.integers(2, 64, size=3).tolist() + pat * reps)
    return out


def hf_reference(cfg: Any, state: dict) -> Any:
    """The HF model (fp32) with the weights the engine serves."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(state)
    return model.eval().to("cuda" if torch.cuda.is_available() else "cpu")


def compare_rows(got: Any, want: Any, moe: list[int], prompt_rows: int) -> dict[str, Any]:
    """Row-by-row comparison of two ``[rows, num_hidden_layers, K]`` route arrays over MoE layers:
    per-layer agreement, differing rows among prompt rows and generated rows, the first differences."""
    import numpy as np

    n = min(len(got), len(want))
    a = np.sort(np.asarray(got[:n])[:, moe].astype(np.int64), -1)
    b = np.sort(np.asarray(want[:n])[:, moe].astype(np.int64), -1)
    eq = (a == b).all(-1)                                        # [rows, moe layers]
    differ = ~eq.all(-1)
    rows = np.nonzero(differ)[0]
    p = min(prompt_rows, n)
    return {"rows": int(n), "per_layer": {int(lid): [int(eq[:, j].sum()), int(n)] for j, lid in enumerate(moe)},
            "agreement": round(float(eq.mean()), 4) if n else None,
            "prompt": [int(differ[:p].sum()), int(p)], "generated": [int(differ[p:].sum()), int(n - p)],
            "differing": [[int(r), [int(moe[j]) for j in np.nonzero(~eq[r])[0]]] for r in rows[:20]]}


def canaries(cmp: dict[str, Any]) -> list[str]:
    from r3bridge.metrics.agreement import agreement_canaries

    return agreement_canaries({int(k): tuple(v) for k, v in cmp["per_layer"].items()},
                              prompt=tuple(cmp["prompt"]), generated=tuple(cmp["generated"]))


def hf_check(pay: Any, ref: Any, facts: dict) -> dict[str, Any]:
    """Each request's routes against the HF model's top-k for the same tokens (from its start row)."""
    import numpy as np
    from sglang_routes import hf_routes

    moe = facts["moe_layer_ids"]
    agree = total = 0
    per = np.zeros(len(moe))
    for i, r in enumerate(pay.routes):
        if r is None:
            continue
        want = hf_routes(ref, pay.tokens(i), moe)[pay.prompt_starts[i]:]
        got = np.asarray(r)[:, moe].astype(np.int64)
        if got.shape != want.shape:
            return {"shape_mismatch": [list(got.shape), list(want.shape)], "request": i}
        eq = (np.sort(got, -1) == np.sort(want, -1)).all(-1)
        agree += int(eq.sum())
        total += eq.size
        per += eq.sum(0)
    return {"hf_agreement": round(agree / total, 4) if total else None,
            "hf_agreement_per_layer": [round(float(x) / (total / len(moe)), 4) for x in per] if total else None}


def decode_check(pay: Any, version: str) -> dict[str, Any]:
    """r3bridge's decoder for the installed release (0.22-0.30 arrays) on every request."""
    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.errors import ReplayError

    try:
        rb = ReplayBatch.from_vllm(list(pay.routes), num_experts=int(pay.meta["num_experts"]),
                                   moe_layer_ids=list(pay.meta["moe_layer_ids"]), start_rows=pay.prompt_starts,
                                   engine_version=version)
    except ReplayError as e:
        return {"decode": f"refused: {type(e).__name__}: {e}"}
    return {"decode": "ok", "rows": int(rb.total_rows)}


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters (``LLM.get_metrics``): drafts, draft and accepted tokens."""
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" in m.name and hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0) + float(m.value)
    except Exception as e:  # noqa: BLE001 - the counters are evidence, not the result
        out["error"] = f"{type(e).__name__}: {e}"            # type: ignore[assignment]
    return out


# The engine settings tried one after another on the device (vllm026_device.sh variants) after
# 0.26.0's generate never returned with vLLM's defaults (docs/gpu-results/vllm-0.26.0): each is
# (environment set before vLLM is imported, more ``vllm.LLM`` arguments, why).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SMALL_KV_BLOCKS = 1024              # x 16 tokens: 64 x (max_model_len 256) x the 16 sequences, with room
VARIANTS: dict[str, tuple[dict[str, str], dict[str, Any], str]] = {
    "default": ({}, {}, "vLLM's defaults: the engine core in its own process (the run that hung)"),
    "inproc": (IN_PROCESS, {}, "the engine core in-process, so one stack dump shows where it waits"),
    "inproc_noroutes": (IN_PROCESS, {"enable_return_routed_experts": False},
                        "the same without routes capture: is capture the cause? (diagnosis only, no routes)"),
    "inproc_small_kv": (IN_PROCESS, {"num_gpu_blocks_override": SMALL_KV_BLOCKS},
                        "a KV pool of 1024 blocks instead of the ~5.4 M blocks (87 M token slots) 0.15 of an "
                        "H200 gives this tiny model: the scheduler's block pool and the RoutedExpertsManager "
                        "slot buffer (1.39 GB) scale with it"),
    # 2026-11-29, 1 x H200: inproc, inproc_noroutes and inproc_small_kv all stopped in the first
    # forward inside vllm_flash_attn's flash_attn_varlen_func (FlashAttention 3, the backend 0.26.0
    # picks on Hopper), so routes capture and the KV pool are not the cause; the attention kernel is
    "inproc_fa2": (IN_PROCESS, {"attention_config": {"flash_attn_version": 2}},
                   "FlashAttention 2 instead of 3 (the first forward stopped inside FA3's varlen kernel)"),
    "inproc_flex": (IN_PROCESS, {"attention_backend": "FLEX_ATTENTION"},
                    "torch's flex attention instead of FlashAttention (the other backend 0.26.0 offers here)"),
    "fa2": ({}, {"attention_config": {"flash_attn_version": 2}},
            "FlashAttention 2 with the engine core in its own process, as vLLM runs by default"),
    # 2026-11-29, second call (beside two SGLang jobs): inproc_fa2 stopped in FA2's varlen kernel the
    # same way (0.26.0's FA2 carries sm_80 SASS + PTX only: Hopper JIT-compiles it at first use),
    # inproc_flex was still in inductor's compile at 30 s. Model A's heads are 8 wide (testlab's
    # tiny_qwen3_moe default): FA3 has no hdim-8 kernel (rounded up to its smallest), TRITON_ATTN
    # refuses < 32 (triton_attn.py:386-387), and 0.26.0 changed the FlashAttention KV page to K and V
    # interleaved per token (flash_attn.py:141/878 vs 0.24.0's :149/768). The next probes
    # (third call: inproc_hd64 returned and the full run passed, so heads of 8 were the trigger):
    "inproc_hd64": (dict(IN_PROCESS, R3E2E_HEAD_DIM="64"), {},
                    "FA3 with heads of 64 (a head size FA3 compiles; SGLang's runs used 64): the setting "
                    "that ran (heads of 8 stall in 0.26.0's FlashAttention call)"),
    "inproc_triton_hd64": (dict(IN_PROCESS, R3E2E_HEAD_DIM="64"), {"attention_backend": "TRITON_ATTN"},
                           "Triton attention (no FlashAttention binary at all; it needs heads >= 32)"),
    "inproc_sync": (dict(IN_PROCESS, CUDA_LAUNCH_BLOCKING="1"), {},
                    "heads of 8 on FA3 with every launch synchronous, so the dump names the kernel that "
                    "never finishes (diagnosis only, never the full run)"),
    "inproc_noaot": (dict(IN_PROCESS, VLLM_BATCH_INVARIANT="1"), {},
                     "heads of 8 on FA3 without the AOT scheduler (VLLM_BATCH_INVARIANT turns it off: "
                     "flash_attn.py:469-471; it changes other kernels too: diagnosis only)"),
    "inproc_hd8_long": (IN_PROCESS, {},
                        "heads of 8 on FA3 with a long generate timeout (GEN_S=150, alone on the GPU): a "
                        "hang or a slow first launch? (diagnosis only)"),
}
ROUTES_OFF = {k for k, (_, kw, _) in VARIANTS.items() if kw.get("enable_return_routed_experts") is False}
# variants that are evidence about the hang only, never the settings of the full run
PROBE_ONLY = ROUTES_OFF | {"inproc_sync", "inproc_noaot", "inproc_hd8_long"}


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """More ``vllm.LLM`` arguments: the variant's, and ``--no-async-scheduling`` (vLLM's asynchronous
    scheduling off; on by default since it is compatible; slime turns it off with routed experts:
    vime #34)."""
    out = dict(VARIANTS[args.variant][1])
    if args.no_async_scheduling:
        out["async_scheduling"] = False
    return out


def apply_variant_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variant's environment, set before anything imports vLLM (``vllm.envs`` reads it lazily,
    but the engine client is chosen when ``LLM`` is built)."""
    env = VARIANTS[args.variant][0]
    os.environ.update(env)
    return dict(env)


def run_probe(args: argparse.Namespace, res: dict) -> bool:
    """One engine (model A, the speculative cases' settings without speculation) and one ``generate``
    of the four speculative prompts, with a stack dump of every thread if it does not return within
    ``--generate-timeout`` s. True when it returned (with routes on, every request's routes too)."""
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm_routes import MODEL_A, _shutdown, write_checkpoint
    from vllm_smoke import llm_kwargs

    path = os.path.join(args.work, "model_A")
    write_checkpoint(path, MODEL_A)
    extra = dict(SPEC_ENGINE, **engine_overrides(args))
    res["engine_kwargs"] = extra
    t = time.monotonic()
    progress(f"probe {args.variant}: starting the engine ({extra})")
    llm = LLM(**llm_kwargs(path, args.gpu_mem, skip_tokenizer_init=True, **extra))
    res["engine_start_s"] = round(time.monotonic() - t, 1)
    cache = llm.llm_engine.vllm_config.cache_config
    res["kv_pool"] = {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
    reqs = spec_prompts()
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False) for _ in reqs]
    progress(f"probe {args.variant}: engine up in {res['engine_start_s']} s; generating {len(reqs)} requests "
             f"(stack dump and exit after {args.generate_timeout} s)")
    faulthandler.dump_traceback_later(args.generate_timeout, exit=True)
    t = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)
    faulthandler.cancel_dump_traceback_later()
    res["generate_s"] = round(time.monotonic() - t, 3)
    routes_on = args.variant not in ROUTES_OFF
    got = []
    for p, o in zip(reqs, outs):
        r = o.outputs[0].routed_experts
        got.append({"prompt": len(p), "generated": len(o.outputs[0].token_ids),
                    "routes_shape": None if r is None else list(np.asarray(r).shape)})
    res["requests"] = got
    progress(f"probe {args.variant}: generated in {res['generate_s']} s: {got}")
    _shutdown(llm)
    if routes_on and any(g["routes_shape"] is None for g in got):
        res["error"] = "generate returned without routes although enable_return_routed_experts was on"
        return False
    return True


def run_spec(args: argparse.Namespace, res: dict, version: str) -> None:
    """Model A without speculation, with n-gram and with a draft model; every request's routes
    compared row by row (reference vs speculative, HF vs both) and asked of the canaries."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm_routes import MODEL_A, ROUTER_STD, _facts, _payloads, _shutdown, hf_config
    from vllm_smoke import llm_kwargs

    from r3bridge.demo.hf_engine import build_hf_model
    from testlab.vllm_payloads import save_payloads

    path = os.path.join(args.work, "model_A")          # written by vllm_routes.generate_cases
    cfg = hf_config(MODEL_A)
    facts = _facts(cfg)
    ref = hf_reference(cfg, build_hf_model(cfg, seed=MODEL_A.seed, router_std=ROUTER_STD).state_dict())
    dpath = os.path.join(args.work, "draft")
    build_hf_model(draft_config(), seed=DRAFT_SEED, router_std=ROUTER_STD).save_pretrained(dpath, safe_serialization=True)
    reqs = spec_prompts()
    max_new = [24, 20, 16, 28]
    cases = res.setdefault("cases", {})
    runs: dict[str, Any] = {}
    for name, spec in (("spec_reference", None), ("spec_ngram", NGRAM),
                       ("spec_draft", {"method": "draft_model", "model": dpath, "num_speculative_tokens": SPEC_TOKENS})):
        c: dict[str, Any] = {"speculative_config": spec}
        cases[name] = c
        try:
            t = time.monotonic()
            extra = dict(SPEC_ENGINE, **engine_overrides(args), **({"speculative_config": spec} if spec else {}))
            progress(f"{name}: starting the engine ({extra})")
            llm = LLM(**llm_kwargs(path, args.gpu_mem, skip_tokenizer_init=True, **extra))
            c["engine_start_s"] = round(time.monotonic() - t, 1)
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                      for n in max_new]
            progress(f"{name}: engine up in {c['engine_start_s']} s; generating {len(reqs)} requests")
            t = time.monotonic()
            outs = llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)
            c["generate_s"] = round(time.monotonic() - t, 1)
            progress(f"{name}: generated in {c['generate_s']} s")
            c["spec_counters"] = spec_counters(llm)
            _shutdown(llm)
            progress(f"{name}: engine shut down")
        except Exception as e:  # noqa: BLE001 - what vLLM does with these settings is the result
            c["engine_error"] = f"{type(e).__name__}: {e}"[:3000]
            c["traceback"] = traceback.format_exc()[-3000:]
            gc.collect()
            torch.cuda.empty_cache()
            continue
        pay = _payloads(reqs, outs, facts, [0] * len(reqs), name)
        pay.meta.update(version=version, speculative_config=spec, greedy=True, model_seed=MODEL_A.seed,
                        draft_seed=DRAFT_SEED if spec and spec["method"] == "draft_model" else None,
                        spec_counters=c["spec_counters"])
        runs[name] = pay
        c["format_problems"] = pay.problems()
        c.update(decode_check(pay, version))
        c.update(hf_check(pay, ref, facts))
        c["canaries_vs_hf"] = canaries(_merged(pay, None, ref, facts))
        if name != "spec_reference" and "spec_reference" in runs:
            base = runs["spec_reference"]
            same = [list(a) == list(b) for a, b in zip(pay.outputs, base.outputs)]
            c["outputs_equal_to_reference"] = same
            cmp = _merged(pay, base, None, facts)
            c["vs_reference"] = cmp
            c["canaries_vs_reference"] = canaries(cmp)
        save_payloads(os.path.join(args.out, f"vllm026_{name}.npz"), pay)
        gc.collect()
        torch.cuda.empty_cache()


def _merged(pay: Any, base: Any, ref: Any, facts: dict) -> dict[str, Any]:
    """``compare_rows`` over every request, summed: against ``base`` (another run's payload, rows of
    the tokens both runs share) or, when ``base`` is None, against the HF model ``ref``."""
    from sglang_routes import hf_routes

    moe = facts["moe_layer_ids"]
    total: dict[str, Any] = {"rows": 0, "per_layer": {int(m): [0, 0] for m in moe}, "prompt": [0, 0],
                             "generated": [0, 0], "differing": {}}
    for i, r in enumerate(pay.routes):
        if r is None:
            continue
        if base is None:
            import numpy as np

            want = np.zeros_like(r)
            want[:, moe] = hf_routes(ref, pay.tokens(i), moe)
            n = len(r)
        else:
            shared = 0                                   # generated tokens both runs agree on
            for a, b in zip(pay.outputs[i], base.outputs[i]):
                if a != b:
                    break
                shared += 1
            # row t routes token t: rows of the prompt and of the shared generated tokens
            n = len(pay.prompts[i]) + shared if shared < len(pay.outputs[i]) else len(r)
            want = base.routes[i]
        c = compare_rows(r[:n], want[:n], moe, len(pay.prompts[i]))      # rows 0..P-1: computed at prefill
        total["rows"] += c["rows"]
        for k, (a, b) in c["per_layer"].items():
            total["per_layer"][k][0] += a
            total["per_layer"][k][1] += b
        for k in ("prompt", "generated"):
            total[k] = [total[k][0] + c[k][0], total[k][1] + c[k][1]]
        if c["differing"]:
            total["differing"][i] = c["differing"]
    agree = sum(a for a, _ in total["per_layer"].values())
    seen = sum(b for _, b in total["per_layer"].values())
    total["agreement"] = round(agree / seen, 4) if seen else None
    return total


def run(args: argparse.Namespace, res: dict) -> None:
    import importlib.metadata

    import torch

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")       # flashinfer not carried
    from vllm_routes import generate_cases
    from vllm_smoke import environment

    from testlab.vllm_payloads import save_payloads

    res["environment"] = environment()
    version = importlib.metadata.version("vllm")
    print(json.dumps(res["environment"]), flush=True)
    cases = res.setdefault("cases", {})
    if not args.spec_only:
        progress("direct cases (vllm_routes.generate_cases)")
        direct, models = generate_cases(args, res, engine_extra=engine_overrides(args))
        progress(f"direct cases generated (engine A {res.get('engine_A_start_s')} s, B {res.get('engine_B_start_s')} s)")
        refs = {k: hf_reference(cfg, state) for k, (cfg, state) in models.items()}
        for case in direct:
            pay = case.payloads
            pay.meta.update(version=version, model_seed=case.model.seed)
            c: dict[str, Any] = {"model": case.model.name, "format_problems": pay.problems(),
                                 "dtype": str(next((r.dtype for r in pay.routes if r is not None), None)),
                                 **{k: pay.meta[k] for k in ("num_cached_tokens", "prompt_rows",
                                                             "prompt_rows_equal_to_first_computation")
                                    if k in pay.meta}}
            c.update(decode_check(pay, version))
            c.update(hf_check(pay, refs[case.model.name], case.facts))
            cases[case.name] = c
            save_payloads(os.path.join(args.out, f"vllm026_{case.name}.npz"), pay)
        del refs
        gc.collect()
        torch.cuda.empty_cache()
    else:
        from vllm_routes import MODEL_A, write_checkpoint

        write_checkpoint(os.path.join(args.work, "model_A"), MODEL_A)
    if not args.direct_only:
        run_spec(args, res, version)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/vllm026"))
    ap.add_argument("--work", default="/tmp/r3b-vllm026")
    ap.add_argument("--gpu-mem", type=float, default=0.15)
    ap.add_argument("--spec-only", action="store_true", help="the speculative-decoding cases only")
    ap.add_argument("--direct-only", action="store_true", help="vllm_routes.py's direct cases only")
    ap.add_argument("--no-async-scheduling", action="store_true", help="vllm.LLM(async_scheduling=False)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="default",
                    help="engine settings: " + "; ".join(f"{k}: {v[2]}" for k, v in VARIANTS.items()))
    ap.add_argument("--probe", action="store_true",
                    help="one engine and one generate only (does the variant return?); exit 0 when it did")
    ap.add_argument("--generate-timeout", type=float, default=45.0,
                    help="--probe: dump every thread's stack and exit when generate has not returned by then")
    ap.add_argument("--dry-run", action="store_true", help="print the settings the run would use and stop")
    args = ap.parse_args(argv)
    if args.variant in PROBE_ONLY and not args.probe:
        ap.error(f"--variant {args.variant} is a diagnosis (routes off or a changed engine): --probe only")
    if args.probe and (args.spec_only or args.direct_only):
        ap.error("--probe runs one engine only: not with --spec-only / --direct-only")
    env = apply_variant_environment(args)
    if args.dry_run:
        # VLLM026_DRY_RUN's stand-in for a hang: the variants named in R3B_DRY_FAIL report one
        hang = args.probe and args.variant in os.environ.get("R3B_DRY_FAIL", "").split()
        print(json.dumps({"variant": args.variant, "environment": env, "engine_kwargs": engine_overrides(args),
                          "probe": args.probe, "out": args.out, "dry_run_hang": hang}))
        return 1 if hang else 0
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)    # `timeout` shows where it stood
    res: dict[str, Any] = {"ran": False, "async_scheduling": "off" if args.no_async_scheduling else "vLLM's default",
                           "variant": args.variant, "variant_environment": env}
    t0 = time.monotonic()
    if args.probe:
        try:
            res["ran"] = run_probe(args, res)
        except Exception as e:  # noqa: BLE001 - reported, exit 1
            res["error"] = f"{type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc()[-6000:]
            print(res["traceback"], file=sys.stderr)
        res["seconds"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(args.out, f"probe_{args.variant}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(json.dumps({k: res.get(k) for k in ("variant", "ran", "engine_start_s", "generate_s", "error")}))
        return 0 if res["ran"] else 1
    try:
        run(args, res)
        res["ran"] = not any("engine_error" in c for c in res.get("cases", {}).values())
    except Exception as e:  # noqa: BLE001 - reported, exit 1
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-6000:]
        print(res["traceback"], file=sys.stderr)
    res["seconds"] = round(time.monotonic() - t0, 1)
    part = "_spec" if args.spec_only else "_direct" if args.direct_only else ""
    with open(os.path.join(args.out, f"vllm026_routes{part}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    brief = {k: {kk: v.get(kk) for kk in ("decode", "rows", "format_problems", "hf_agreement", "hf_agreement_per_layer",
                                          "engine_start_s", "engine_error", "spec_counters",
                                          "outputs_equal_to_reference", "canaries_vs_reference", "canaries_vs_hf",
                                          "num_cached_tokens", "prompt_rows_equal_to_first_computation")
                 if kk in v} for k, v in res.get("cases", {}).items()}
    for k, v in res.get("cases", {}).items():
        if "vs_reference" in v:
            brief[k]["vs_reference"] = {kk: v["vs_reference"][kk] for kk in ("rows", "agreement", "prompt", "generated",
                                                                            "per_layer")}
    print(json.dumps({"ran": res["ran"], "seconds": res["seconds"], "error": res.get("error"),
                      "engine_A_start_s": res.get("engine_A_start_s"), "engine_B_start_s": res.get("engine_B_start_s"),
                      "cases": brief}, default=str))
    return 0 if res["ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
