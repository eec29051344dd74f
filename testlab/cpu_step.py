"""One replayed PPO step through verl's, SkyRL's or AReaL's own training path, on the CPU harness.

The quick check of the guides' "Try it on CPU" (docs/use-with-skyrl.md, use-with-areal.md; verl's
guide rehearses verl's own launch line instead: examples/verl/run_cpu_rehearsal.sh):

    python /path/to/r3bridge/testlab/cpu_step.py verl|skyrl|areal [--mode R3|R2|off] [--steps N] [--trace-dir DIR]
        [--route-transport inline|handles (skyrl)]

It runs the same code as the suite's real-path tests, in one gloo rank (docs/testing-harness.md
lists what stands in for what a CPU cannot run): verl's ``TrainingWorker`` (``infer_batch``,
``train_mini_batch``) with r3bridge's engine from verl's registry (testlab.verl_job), SkyRL 0.3's
``MegatronModelWrapper`` behind ``PolicyWorkerMixin`` (testlab.skyrl_real), AReaL's
``MegatronPPOActor`` with r3bridge's mixins (testlab.areal_runner). Every router call is compared
with the routes it had to dispatch. Printed: the adapter's startup line (logger ``r3bridge``, from
the rank process), the ``r3bridge/*`` metrics as the framework returned them, and one line per
step, ``checked`` (token, layer) pairs and ``mismatching``. Exit status 1 when any call dispatched
other routes than it should have. ``--mode off`` reports the same comparison as the baseline (how
often native routing differs from the rollout's routes), exit 0; ``--trace-dir`` writes route traces
(``r3bridge inspect DIR``).

Runs from any folder, with r3bridge installed editable or not: testlab/ is r3bridge's test lab (not
in the wheel), so the checkout is appended to ``sys.path``, after site-packages, and the installed
r3bridge is the one imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("verl", "skyrl", "areal")
# SkyRL's update sees the samples in another order than compute_log_prob, re-partitioned
SKYRL_PERMUTE = [5, 1, 0, 4, 2, 7, 3, 6]


def _verl(ctx: Any, workdir: str, mode: str, steps: int) -> dict:
    from testlab import verl_job

    layout = verl_job.JobLayout(recompute=True)
    res = verl_job.run_training_worker(ctx, verl_job.write_tiny_qwen3_moe(workdir), layout, mode, steps)
    per_step: dict[str, list] = {}
    for p in res["passes"]:  # "step0/compute_log_prob", "step0/update", ...: step 1, ...
        per_step.setdefault(f"step {int(p.phase.split('/')[0][4:]) + 1}", []).append(p)
    return {
        "steps": [
            {
                "what": f"{step} {' + '.join(p.phase.split('/', 1)[1] for p in ps)}",
                "checked": sum(p.checked_rows for p in ps),
                "mismatching": sum(len(p.mismatches) for p in ps),
                "first": [m for p in ps for m in p.mismatches][:3],
            }
            for step, ps in per_step.items()
        ],
        "metrics": res.get("metric_values", []),
    }


def _skyrl(ctx: Any, workdir: str, mode: str, steps: int, route_transport: str = "inline") -> dict:
    from r3bridge.testing.harness.models import ModelSpec
    from r3bridge.testing.kit.conformance import make_rollout
    from testlab.skyrl_real import StepSpec, run_steps

    spec = ModelSpec(num_layers=4, moe_layer_freq=[0, 1, 1, 1], recompute="full")
    rollouts = [
        make_rollout(
            21 + s,
            batch_size=8,
            num_experts=spec.num_moe_experts,
            topk=spec.moe_router_topk,
            num_layers=4,
            moe_layer_ids=[1, 2, 3],
        )
        for s in range(steps)
    ]
    res = run_steps(ctx, spec, StepSpec(mode=mode, remove_microbatch_padding=False, permute=SKYRL_PERMUTE,
                                        route_transport=route_transport, routes_dir=os.path.join(workdir, "routes")),
                    rollouts)
    out = []
    for i, s in enumerate(res["steps"]):
        errors = s.get("fwd_errors", []) + s.get("upd_errors", [])
        out.append(
            {
                "what": f"step {i + 1} compute_log_prob + update",
                "checked": s.get("fwd_checked", 0) + s.get("upd_checked", 0),
                "mismatching": len(errors),
                "first": errors[:3],
            }
        )
    # SkyRL's per-micro-batch metrics of the update (its trainer logs them with "policy/" in front)
    return {
        "steps": out,
        "metrics": [{k: v for k, v in s["logged"].items() if k.startswith("r3bridge/")} for s in res["steps"]],
    }


def _areal(ctx: Any, workdir: str, mode: str, steps: int) -> dict:
    from r3bridge.testing.kit.conformance import make_rollout
    from testlab.areal_runner import run_steps

    rollout = make_rollout(11, batch_size=8, num_experts=4, topk=2, max_prompt=40)
    res = run_steps(ctx, mode, rollout, workdir, steps=steps, n_mbs=2, ppo_n_minibatches=2)
    # AReaL's runner checks all passes of all steps together
    return {
        "steps": [
            {
                "what": f"{steps} step(s), compute_logp + ppo_update",
                "checked": res["checked_rows"],
                "mismatching": len(res["errors"]),
                "first": [str(e) for e in res["errors"][:3]],
            }
        ],
        "metrics": res["metrics"],
    }


def _rank(ctx: Any, framework: str, workdir: str, mode: str, steps: int, route_transport: str = "inline") -> dict:
    if framework == "skyrl":
        return _skyrl(ctx, workdir, mode, steps, route_transport)
    run = {"verl": _verl, "areal": _areal}[framework]
    return run(ctx, workdir, mode, steps)


def _value(v: Any) -> str:
    """A logged metric: a number, or verl's per-micro-batch list of numbers."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(f"{float(x):.4g}" for x in v) + "]"
    return f"{float(v):.4g}"


def report(res: dict, mode: str) -> tuple[list[str], int]:
    """The lines cpu_step prints after the run, and its exit status. Under R2 / R3 every checked
    (token, layer) pair must dispatch its target (exit 1 otherwise). Under ``off`` nothing replays:
    the same comparison is the *baseline*, how often the trainer's own routing differs from the
    routes the rollout sampled with (what R3 removes); it is reported as such, never as a failure."""
    # steps count from 1, as verl's and the route traces' (`r3bridge inspect`, printed after these lines)
    lines = [f"step {i} metrics: " + ", ".join(f"{k}={_value(v)}" for k, v in sorted(m.items()))
             for i, m in enumerate(res["metrics"], 1)]
    bad = checked = 0
    for s in res["steps"]:
        bad += s["mismatching"]
        checked += s["checked"]
        if mode == "off":
            lines.append(f"{s['what']}: {s['checked']} (token, layer) pairs compared with the rollout's routes, "
                         f"{s['mismatching']} routed differently by the trainer's own router (baseline, replay off)")
        else:
            lines.append(f"{s['what']}: {s['checked']} (token, layer) pairs checked against the routes they had to "
                         f"dispatch, {s['mismatching']} mismatching" + (f": {s['first']}" if s["first"] else ""))
    if mode == "off":
        share = f"{bad / checked:.0%}" if checked else "no pairs"
        lines.append(f"cpu_step: BASELINE (replay off): {share} of the (token, layer) pairs routed differently from "
                     f"the rollout; with --mode R3 every one of them dispatches the rollout's route")
        return lines, 0
    lines.append(f"cpu_step: {'FAILED' if bad else 'OK'}")
    return lines, 1 if bad else 0


def _installed(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment_problems(framework: str, *, installed=_installed, importable=None) -> list[str]:
    """What this environment lacks for the CPU step, one line each, found before a rank is spawned
    (where each would be a traceback from deep inside an import). Both were met on Python 3.12, where
    pip resolves newer releases than on 3.11:

    * megatron-core 0.18 and later import triton in ``import megatron.core`` (0.18.2, 0.19.2:
      ``megatron/core/transformer/moe/ops/paged_stash.py``); torch's CPU build does not bring triton.
      0.16.1, the release the suite runs, imports without it (the guides' blocks pin it).
    * SkyRL 0.4's ``MegatronModelWrapper`` imports ``megatron.bridge`` at module level
      (``skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:8``); Megatron-Bridge
      needs Transformer Engine, so no CPU machine has it. The CPU step runs SkyRL 0.3."""
    import importlib.util

    from packaging.version import Version

    importable = importable or (lambda name: importlib.util.find_spec(name) is not None)
    problems = []
    mcore = installed("megatron-core")
    if mcore is not None and Version(mcore) >= Version("0.18") and not importable("triton"):
        problems.append(f"megatron-core {mcore} imports triton (megatron/core/transformer/moe/ops/paged_stash.py), "
                        "which torch's CPU build does not bring: pip install megatron-core==0.16.1 (the release the "
                        "CPU steps run; the guide's block pins it), or pip install triton")
    skyrl = installed("skyrl") if framework == "skyrl" else None
    if skyrl is not None and Version(skyrl) >= Version("0.4") and not importable("megatron.bridge"):
        problems.append(f"SkyRL {skyrl}'s MegatronModelWrapper imports megatron.bridge at module level "
                        "(skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py), and Megatron-Bridge "
                        "needs Transformer Engine (a GPU): the CPU step runs SkyRL 0.3, pip install skyrl==0.3.0 "
                        "(the guide's block pins it)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpu_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("framework", choices=FRAMEWORKS)
    p.add_argument("--mode", default="R3", choices=("R3", "R2", "off"))
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--trace-dir", default=None,
                   help="write route traces there (the r3bridge option trace_dir; read them with r3bridge inspect)")
    p.add_argument("--route-transport", default="inline", choices=("inline", "handles"),
                   help="skyrl: handles = each step's routes written once, each rank reading its rows "
                        "(docs/route-handles.md)")
    args = p.parse_args(argv)
    if args.route_transport != "inline" and args.framework != "skyrl":
        p.error(f"--route-transport {args.route_transport}: wired here for skyrl only (docs/route-handles.md)")
    problems = environment_problems(args.framework)
    if problems:
        print("\n".join(f"error: {line}" for line in problems), file=sys.stderr, flush=True)
        return 2

    import r3bridge
    from r3bridge.config import ENV_CONFIG
    from r3bridge.testing.harness.dist import spawn

    if args.trace_dir:
        # the option reaches the framework's worker as a user's would: R3BRIDGE_CONFIG, which every
        # adapter merges with the section the runner sets (replay_mode)
        env = json.loads(os.environ.get(ENV_CONFIG) or "{}")
        env["trace_dir"] = os.path.abspath(args.trace_dir)
        os.environ[ENV_CONFIG] = json.dumps(env)
    print(
        f"cpu_step: {args.framework}, replay_mode={args.mode}, {args.steps} step(s), 1 gloo rank, "
        f"route_transport={args.route_transport}; "
        f"r3bridge {r3bridge.__version__} from {os.path.dirname(r3bridge.__file__)}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix=f"r3bridge-cpu-step-{args.framework}-") as workdir:
        (res,) = spawn(_rank, world_size=1, args=(args.framework, workdir, args.mode, args.steps, args.route_transport),
                       timeout=900)
    lines, rc = report(res, args.mode)
    if args.trace_dir and args.mode != "off":
        lines.insert(-1, f"route traces: {os.path.abspath(args.trace_dir)} (r3bridge inspect {args.trace_dir})")
    print("\n".join(lines), flush=True)
    return rc


if __name__ == "__main__":
    sys.path[0:1] = []  # this folder: testlab's modules are imported as testlab.*
    sys.path.append(ROOT)  # after site-packages: an installed r3bridge wins over the checkout's
    from testlab.cpu_step import main as _main  # the rank function must pickle as testlab.cpu_step._rank

    sys.exit(_main())
