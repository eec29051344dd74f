"""Smoke test of real vLLM on the device: the tiny Qwen3-MoE of verl's GPU job, routes returned.

Writes the HF checkpoint verl's job serves (``testlab.verl_e2e.write_model(save_weights=True)``:
config, word-level tokenizer, safetensors; no hub), starts ``vllm.LLM`` on it with
``enable_return_routed_experts=True`` (a small ``gpu_memory_utilization`` so other work can share
the GPU; CUDA graphs, prefix caching and chunked prefill at vLLM's defaults), generates a few
requests from token ids and checks every ``CompletionOutput.routed_experts`` against vLLM's
documented format (``testlab.vllm_payloads.vllm_format_problems``: shape ``[prompt + response - 1,
num_hidden_layers, top_k]``, uint8 / uint16 by expert count, zero dense-layer rows, ids in range
and distinct per MoE row) and through ``ReplayBatch.from_vllm``. Writes ``$OUT/vllm_smoke.json``
and the raw arrays ``$OUT/vllm_smoke.npz`` (the CPU tests' fixture format). Exit 0 only when every
request's routes are as documented; otherwise one line per deviation and exit 1.

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site-vllm:$PWD python scripts/gpu/vllm_smoke.py --out $OUT

(``VLLM_USE_FLASHINFER_SAMPLER=0``: the wheel set carries no flashinfer, and vLLM 0.24.0's sampler
imports it unguarded when the variable is at its default; the script sets it too.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

PROMPT_LENS = (9, 24, 17, 40)
MAX_TOKENS = (12, 20, 7, 16)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    g = np.random.default_rng(seed)
    return [g.integers(1, vocab, size=n).tolist() for n in PROMPT_LENS]


def llm_kwargs(path: str, gpu_mem: float, **extra: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments: the saved checkpoint, routes returned, bf16, a small memory share."""
    # the caller's settings win (a case may ask for other limits)
    return {**dict(model=path, tokenizer=path, dtype="bfloat16", seed=0, gpu_memory_utilization=gpu_mem,
                   max_model_len=256, max_num_seqs=16, enable_return_routed_experts=True), **extra}


def model_facts(cfg: Any) -> dict[str, Any]:
    from r3bridge.hf import ModelInfo

    info = ModelInfo.from_hf_config(cfg)
    return {"num_experts": info.num_experts, "num_hidden_layers": info.num_layers, "topk": info.topk,
            "moe_layer_ids": list(info.moe_layer_ids)}


def check(requests: list[list[int]], outputs: list[Any], facts: dict[str, Any], *, starts: list[int] | None = None
          ) -> tuple[Any, list[str]]:
    """(``Payloads`` of what vLLM returned, deviations from its format and from the requests)."""
    from testlab.vllm_payloads import Payloads

    starts = starts or [0] * len(requests)
    problems, routes, outs = [], [], []
    for i, (p, o) in enumerate(zip(requests, outputs)):
        if list(o.prompt_token_ids) != list(p):
            problems.append(f"request {i}: vLLM echoed other prompt ids than were sent")
        c = o.outputs[0]
        routes.append(c.routed_experts)
        outs.append(list(c.token_ids))
    pay = Payloads(routes, [list(p) for p in requests], outs, {**facts, "prompt_start": list(starts)})
    problems += pay.problems()
    if not problems:
        try:
            rb = pay.replay_batch()
            if rb.rows_per_seq != [len(p) + len(o) - 1 - s for p, o, s in zip(requests, outs, starts)]:
                problems.append(f"ReplayBatch rows {rb.rows_per_seq} differ from prompt + output - 1 - start")
        except Exception as e:  # noqa: BLE001 - any refusal is a deviation here
            problems.append(f"ReplayBatch.from_vllm refused: {type(e).__name__}: {e}")
    return pay, problems


def environment() -> dict[str, Any]:
    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "glibc": "-".join(platform.libc_ver()),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")}


def set_environment() -> None:
    """Before vLLM and testlab.verl_e2e are imported: no FlashInfer sampler (not carried), and the
    model verl's GPU job serves (all MoE: scripts/gpu/verl_e2e.sh sets R3E2E_DENSE=none)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("R3E2E_DENSE", "none")


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_environment()
    from transformers import AutoConfig

    from testlab import verl_e2e
    from testlab.vllm_payloads import save_payloads

    res: dict[str, Any] = {"pass": False}
    t0 = time.monotonic()
    path = os.path.join(args.work, "model")
    verl_e2e.write_model(path, save_weights=True)
    cfg = AutoConfig.from_pretrained(path)
    facts = model_facts(cfg)
    res.update(model=facts, dense=list(verl_e2e.DENSE))
    res["environment"] = environment()
    print(json.dumps(res["environment"]), flush=True)
    from vllm import LLM, SamplingParams

    t1 = time.monotonic()
    llm = LLM(**llm_kwargs(path, args.gpu_mem))
    res["engine_start_s"] = round(time.monotonic() - t1, 1)
    reqs = prompts(int(cfg.vocab_size))
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True, logprobs=0)
              for i, n in enumerate(MAX_TOKENS)]
    t2 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)
    res["generate_s"] = round(time.monotonic() - t2, 2)
    pay, problems = check(reqs, outs, facts)
    pay.meta.update(engine="vllm", version=res["environment"]["vllm"], recorded=True, case="smoke",
                    device=res["environment"]["device"])
    save_payloads(os.path.join(args.out, "vllm_smoke.npz"), pay)
    res["requests"] = [{"prompt": len(p), "output": len(o), "routes_shape": None if r is None else list(r.shape),
                        "dtype": None if r is None else str(r.dtype)}
                       for p, o, r in zip(pay.prompts, pay.outputs, pay.routes)]
    res["problems"] = problems
    res["pass"] = not problems
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/vllm"))
    ap.add_argument("--work", default="/tmp/r3b-vllm-smoke")
    ap.add_argument("--gpu-mem", type=float, default=0.15, help="vLLM's gpu_memory_utilization")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"pass": False}
    try:
        res = run(args)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, exit 1
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        print(res["traceback"], file=sys.stderr)
    with open(os.path.join(args.out, "vllm_smoke.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({k: res.get(k) for k in ("pass", "engine_start_s", "generate_s", "seconds", "requests",
                                              "problems", "error")}, default=str))
    return 0 if res.get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
