"""A stand-in for ``python -m sglang.launch_server`` on a CPU machine (tests only).

It takes the same command line as the real server (the flags :func:`testlab.areal_sglang.server_command`
builds; unknown ones are ignored) and answers the endpoints AReaL 1.0.4's ``RemoteSGLangEngine``
calls, in SGLang 0.5.12's JSON: ``GET /health``; ``POST /generate`` with ``meta_info``
(``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason``,
``output_token_logprobs``, ``routed_experts``: base64 int32 flattened ``[tokens - 1, layers, top_k]``
from row 0); ``POST /pause_generation`` (mode ``abort``: every request in flight returns at once
with ``finish_reason.type == "abort"`` and what it generated so far) and ``/continue_generation``.

So that the device run fails on nothing but SGLang, the CPU test runs AReaL's whole client path
(its executor, workflow, resubmit loop, aiohttp) against this process. Its routes are drawn
from the token prefix and the request number, so a row recomputed by a later request can differ
from the first computation (as a real engine's re-prefill can); rows of a prefix it has served
before are returned as first computed and counted in ``cached_tokens`` (the radix cache).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import zlib

import numpy as np

__all__ = ["main"]


class _Model:
    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        self.layers = int(cfg["num_hidden_layers"])
        self.topk = int(cfg["num_experts_per_tok"])
        self.experts = int(cfg.get("num_experts") or cfg["num_local_experts"])   # transformers 5.10+: the latter
        self.vocab = int(cfg["vocab_size"])
        self.cache: dict[tuple, np.ndarray] = {}       # token prefix -> its last token's routes
        self.requests = 0
        self.paused = False
        self.abort = asyncio.Event()

    def row(self, prefix: tuple, request: int) -> np.ndarray:
        g = np.random.default_rng(zlib.crc32(repr((prefix[-4:], len(prefix), request % 3)).encode()))
        return np.stack([g.permutation(self.experts)[: self.topk] for _ in range(self.layers)]).astype("<i4")

    async def generate(self, body: dict) -> dict:
        self.requests += 1
        req = self.requests
        prompt = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        stop_ids = set(sp.get("stop_token_ids") or [])
        g = np.random.default_rng(zlib.crc32(repr(prompt).encode()))
        out: list[int] = []
        reason = {"type": "length", "length": int(sp.get("max_new_tokens", 16))}
        while len(out) < int(sp.get("max_new_tokens", 16)):
            if self.abort.is_set():
                reason = {"type": "abort", "message": "Abort all requests (pause_generation)"}
                break
            await asyncio.sleep(0.01)
            tok = int(g.integers(0, self.vocab))        # the stop ids (eos, pad) included: lengths vary
            out.append(tok)
            if tok in stop_ids and not sp.get("ignore_eos"):
                reason = {"type": "stop", "matched": tok}
                break
        tokens = prompt + out
        cached = 0
        while cached < len(prompt) - 1 and tuple(tokens[: cached + 1]) in self.cache:
            cached += 1
        rows = []
        for j in range(len(tokens) - 1):
            key = tuple(tokens[: j + 1])
            if j < cached:
                rows.append(self.cache[key])
            else:
                r = self.row(key, req)
                self.cache.setdefault(key, r)
                rows.append(r)
        routes = np.stack(rows) if rows else np.zeros((0, self.layers, self.topk), "<i4")
        meta = {"id": f"req{req}", "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(out), "cached_tokens": cached,
                "output_token_logprobs": [[-1.0, t, None] for t in out]}
        if body.get("return_routed_experts"):
            meta["routed_experts"] = base64.b64encode(routes.astype("<i4").tobytes()).decode("ascii")
        return {"output_ids": out, "meta_info": meta}


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    a, _ = ap.parse_known_args(argv)
    model = _Model(a.model_path)

    async def health(_req: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def generate(req: web.Request) -> web.Response:
        return web.json_response(await model.generate(await req.json()))

    async def pause(_req: web.Request) -> web.Response:
        model.abort.set()
        await asyncio.sleep(0.05)
        return web.json_response({"success": True})

    async def cont(_req: web.Request) -> web.Response:
        model.abort.clear()
        return web.json_response({"success": True})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/health_generate", health),
                    web.post("/generate", generate), web.post("/pause_generation", pause),
                    web.post("/continue_generation", cont)])
    web.run_app(app, host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
