#!/usr/bin/env python3
"""AReaL 1.0.4's real ``MegatronPPOActor`` with r3bridge on one or two GPUs, R3 and R2 (issue 23, item 3).

AReaL's own actor (with r3bridge's ``MegatronEngineMixin`` / ``PPOActorMixin``) runs 2 PPO steps
per mode: ``compute_logp`` -> ``compute_advantages`` -> ``ppo_update`` (AReaL's GRPO loss,
megatron's optimizer over DDP chunks, full recompute), its tiny Qwen3-MoE built through mbridge as
AReaL builds it. Rollout side: r3bridge's SGLang-format routes (``meta_info``), decoded by AReaL's
own ``SGLangBackend`` and ``WorkflowMixin`` (``testlab.areal_rollout``). Every router call of every
pass (forward, update, recompute) is checked against the routes that had to be replayed (the
rollout's under R3, those recorded in that step's compute_logp under R2), sharded for AReaL's own
padded ``cu_seqlens``, and logged as dispatch records keyed by (sample, token), compared with the
same routes independently. The code is ``testlab.areal_runner`` (the CPU runner of
tests/adapters/test_areal_real.py); this file only spawns it on a device.

  --layout tp1 (default), tp2_sp or pp2_vpp2 (two ranks, each with its own LOCAL_RANK: AReaL pins its
    GPU from it, testlab/areal_engine.py); every rank's router calls checked, dispatch records merged.
  --device cuda (default): NCCL, one GPU per rank, the model on the GPU (mbridge's ``.cuda()``),
    megatron's optimizer without the CPU proxy. Layer spec: megatron's local spec with MoE-only
    layers (``testlab.mbridge_spec``'s TE-free bridge: AReaL packs THD, which local attention
    refuses), fp32 (AReaL's harness dtype).
  --device cpu: gloo with the CPU shim (what `make test` runs), for a smoke test here.
  --rollout synth (default): the routes above. --rollout sglang: a real SGLang server (issue 46, item 1;
    ``testlab.areal_sglang``): ``python -m sglang.launch_server`` on a tiny Qwen3-MoE folder written here
    (every layer MoE, 8 experts top-2; ``--enable-return-routed-experts``, triton attention, pytorch
    sampling, ``--mem-fraction-static`` 0.25, the radix cache on) started as a subprocess (readiness wait
    on /health, hard timeout ``--server-timeout``, its log's tail in the error), in the environment
    ``--server-pythonpath`` gives it; AReaL's ``RemoteSGLangEngine`` (r3bridge's ``SGLangEngineMixin``)
    and executor run AReaL's ``MultiTurnWorkflow`` (r3bridge's ``WorkflowMixin``) over HTTP, with one or
    more interruptions as AReaL's weight update makes them (``pause`` + ``pause_generation``, then
    ``continue_generation`` + ``resume``: the requests in flight abort and AReaL's client resubmits them),
    each once the server has answered ``--interrupt-after`` responses in all.
    The server is stopped, then the actor trains on those trajectories, R3 replaying the routes rebuilt
    from every recorded attempt (independently of the adapter), every router row checked as above.
    Also written: <out>/areal_sglang_payloads.json (every attempt's request ids and SGLang meta_info:
    the CPU fixture tests/fixtures/sglang_areal/ is made from it), <out>/sglang_server.log.
    ``--dry-run``: build and print the AReaL config, the workflow, the episodes and the server's
    command line, start nothing. ``--server-module testlab.sglang_http_stub``: the CPU stand-in server.

Output: one JSON line (also <out>/areal_actor.json): ``ok`` and, per mode,
``router_rows_mismatched`` (0), ``router_rows_checked`` (> 0), ``errors`` ([]),
``dispatch_errors`` ([]), ``dispatch_compared`` (> 0), ``calls`` per pass, ``grad_norms``; with
``--rollout sglang`` also ``rollout``: the server's start time, the rollout's, and its checks (``ok``:
the adapter's stitched routes equal the recorded first-seen ones in every sample, some samples ran
more than one turn, some were resubmitted, some rows came from cached prefixes).
Exit status 0 iff ok.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


# --layout: the layouts of the CPU test (tests/adapters/test_areal_real.py) with its micro-batch
# counts: at TP2 one micro-batch per pass (AReaL pads each to a 256-token page: with two, the second
# sequence-parallel half would hold padding only); under PP AReaL raises every pass to >= 2 * pp.
LAYOUTS = {"tp1": ({}, 2), "tp2_sp": ({"tp": 2}, 1), "pp2_vpp2": ({"pp": 2, "vpp": 2}, 2)}


def _cell(ctx: Any, workdir: str, device: str, steps: int, n_mbs: int = 2, recorded: Any = None) -> dict:
    """Both modes on this rank; ``recorded``: a real rollout (``testlab.areal_sglang.RecordedRollout``),
    else the synthesised one."""
    from testlab.areal_runner import run_steps
    from testlab.device_runs import areal_rollout

    hf = None
    if recorded is not None:
        from testlab.areal_sglang import hf_config

        hf = hf_config()
    out = {}
    for mode in ("R3", "R2"):
        t0 = time.time()
        res = run_steps(
            ctx,
            mode,
            recorded if recorded is not None else areal_rollout(),
            f"{workdir}/{mode}/rank{ctx.rank}",
            steps=steps,
            n_mbs=n_mbs,
            ppo_n_minibatches=n_mbs,
            device=device,
            hf_config=hf,
        )
        res["mismatched"] = sum(r["mismatched"] for r in res.pop("records"))
        res["seconds"] = round(time.time() - t0, 2)
        out[mode] = res
    return out


def summarize(per_rank: list, steps: int, recorded: Any = None) -> dict:
    """Per mode, over every rank: the runner's router-call checks summed, the dispatch records merged
    over the ranks and compared with the routes that had to be replayed (``recorded``: a real
    rollout's, else the synthesised one's)."""
    from r3bridge.batch.schema import ReplayBatch
    from testlab.device_runs import areal_rollout, dispatch_disagreements
    from testlab.dispatch_records import DispatchRecords

    rollout = recorded if recorded is not None else areal_rollout()
    lens = [len(t) for t in rollout.tokens]
    modes, ok = {}, True
    for mode in ("R3", "R2"):
        ranks = [res[mode] for res in per_rank]
        recs = DispatchRecords.merge([x["dispatch"] for x in ranks])
        calls: dict[str, int] = {}
        for x in ranks:
            for k, v in x["calls"].items():
                calls[k] = calls.get(k, 0) + v
        r = ranks[0]
        m: dict[str, Any] = {
            "router_rows_mismatched": sum(x["mismatched"] for x in ranks),
            "router_rows_checked": sum(x["checked_rows"] for x in ranks),
            "errors": [f"rank {i}: {e}" for i, x in enumerate(ranks) for e in x["errors"]][:5],
            "calls": calls,
            "grad_norms": r["grad_norms"],
            "dispatch_errors": [],
            "dispatch_compared": 0,
            "seconds": max(x["seconds"] for x in ranks),
            "metrics_last_step": ranks[-1]["metrics"][-1] if ranks[-1]["metrics"] else {},
        }
        for step in range(steps):
            want = rollout.expected() if mode == "R3" else ReplayBatch.from_bytes(r["recorded"][step])
            errs, n = dispatch_disagreements(recs.where(step=step), want, lens, f"areal {mode}")
            m["dispatch_errors"] += errs[:5]
            m["dispatch_compared"] += n
        m["ok"] = (
            not m["errors"]
            and m["router_rows_mismatched"] == 0
            and m["router_rows_checked"] > 0
            and not m["dispatch_errors"]
            and m["dispatch_compared"] > 0
            and all(x["calls"].get("update/recompute", 0) > 0 for x in ranks)
        )
        ok = ok and m["ok"]
        modes[mode] = m
    return {"ok": ok, "modes": modes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layout", default="tp1", choices=sorted(LAYOUTS), help="tp1 (1 GPU), tp2_sp or pp2_vpp2 (2 ranks)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--rollout", default="synth", choices=["synth", "sglang"],
                    help="synth: r3bridge's SGLang-format routes; sglang: a real SGLang server through AReaL's client")
    ap.add_argument("--dry-run", action="store_true", help="--rollout sglang: build everything, print it, start nothing")
    ap.add_argument("--server-pythonpath", default=None, help="the server's PYTHONPATH (SGLang's site), replacing ours")
    ap.add_argument("--server-module", default="sglang.launch_server")
    ap.add_argument("--server-timeout", type=float, default=300, help="s until the server must answer /health")
    ap.add_argument("--mem-fraction", type=float, default=0.25, help="SGLang's --mem-fraction-static")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--interrupt-after", default="1,5,10",
                    help="AReaL's pause / resume once the server has answered this many responses in all")
    a = ap.parse_args()
    if a.dry_run:
        from testlab.areal_sglang import dry_run
        from testlab.device_runs import emit

        with tempfile.TemporaryDirectory(prefix="areal-sglang-dry-") as workdir:
            emit(a.out, "areal_actor_dry_run", dry_run(workdir, n=a.episodes, max_new_tokens=a.max_new_tokens,
                                                       mem_fraction=a.mem_fraction, module=a.server_module,
                                                       server_pythonpath=a.server_pythonpath))
        return 0

    import importlib.metadata as md

    from r3bridge.testing.harness.dist import Layout, spawn_layouts
    from testlab.device_runs import backend_of, emit, error_text

    head = {
        "framework": "areal",
        "areal": md.version("areal"),
        "mbridge": md.version("mbridge"),
        "megatron_core": md.version("megatron-core"),
        "device": a.device,
        "layer_spec": "local (MoE-only)",
        "layout": a.layout,
        "rollout": a.rollout,
    }
    if a.device == "cuda":
        import torch

        head["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.time()
    recorded = None
    try:
        with tempfile.TemporaryDirectory(prefix="areal-actor-") as workdir:
            if a.rollout == "sglang":
                from testlab.areal_sglang import serve_and_roll

                recorded, head["rollout_sglang"] = serve_and_roll(
                    f"{workdir}/sglang", a.out, n=a.episodes, max_new_tokens=a.max_new_tokens,
                    mem_fraction=a.mem_fraction, module=a.server_module, server_pythonpath=a.server_pythonpath,
                    server_timeout=a.server_timeout, interrupts=[int(x) for x in a.interrupt_after.split(",")])
                head["rollout_sglang"]["checks"].pop("per_sample", None)
            kw, n_mbs = LAYOUTS[a.layout]
            layout = Layout(**kw)
            (per_rank,) = spawn_layouts(
                _cell,
                world_size=layout.tp * layout.pp,
                layouts=[layout],
                args=(workdir, a.device, a.steps, n_mbs, recorded),
                backend=backend_of(a.device),
                timeout=a.timeout,
            )
        summary = {**head, **summarize(per_rank, a.steps, recorded)}
        if recorded is not None:
            summary["ok"] = summary["ok"] and head["rollout_sglang"]["checks"]["ok"]
    except Exception as e:  # a failed rank: its traceback is the result
        summary = {**head, "ok": False, "error": error_text(e)}
    summary["seconds"] = round(time.time() - t0, 1)
    emit(a.out, "areal_actor", summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
