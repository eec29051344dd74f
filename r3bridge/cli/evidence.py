"""``r3bridge evidence``: what routing replay does to a GRPO run, off vs R2 vs R3, and its figure.

``evidence run`` trains a tiny Qwen3-MoE on generated additions (a supervised warm start, then
GRPO with 4 mini-batches per rollout batch and the engine's weights synced every step), one arm
per replay mode and seed plus a noise floor, side by side, within a wall-clock bound
(r3bridge/demo/evidence.py). ``--calibrate`` first tries candidate models side by side and runs
the first whose trainer and engine disagree on enough routes (``--max-agreement``); ``--arms
issue49`` is the 13-arm set of issue 49; ``--warm-start DIR`` reuses an earlier run's warm start
(another device session: the same model, task and weights, so its arms join the earlier ones).
``evidence plot`` (or ``report``) reads the arms' logs back, of one run or several: the table
of ratios after warm-up, the goals met or not, and the per-step figure. docs/evidence.md has the
method and the published numbers.

Candidate specs (``--calibrate``): ``L<layers>-E<experts>-k<topk>-h<hidden>-f<moe ffn>-aux<coef>-
z<coef>-lr<lr>[-dense]`` joined by commas, any part left out taken from the other options.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from r3bridge.cli._common import CliError, installed, print_json, pyplot, require, save_figure

NAME = "evidence"
COLORS = {"off": "tab:red", "R2": "tab:orange", "R3": "tab:blue", "R3w": "tab:green", "floor": "tab:gray",
          "R2-mb1": "gold", "R3-mb1": "tab:cyan", "R2-mb8": "tab:brown", "R3-mb8": "tab:purple"}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _modes(text: str) -> list[str]:
    modes = [x.strip() for x in text.split(",") if x.strip()]
    bad = [m for m in modes if m not in ("off", "R2", "R3", "R3w")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are off, R2, R3, R3w (comma-separated), got {text!r}")
    return modes


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="GRPO run off / R2 / R3 side by side, and its figure",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="evidence_command", metavar="{run,plot,report,status}")
    cmds.required = True
    r = cmds.add_parser("run", help="the whole run: warm start, then every arm, within --wall-s")
    r.add_argument("--out", required=True, help="run folder (created); logs in OUT/logs")
    r.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                   help="rollout engine: vllm (in-process vLLM, bf16; GPU) or hf (HF transformers)")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    r.add_argument("--modes", type=_modes, default=["off", "R2", "R3"])
    r.add_argument("--seeds", type=_ints, default=[0, 1, 2])
    r.add_argument("--no-floor", action="store_true", help="leave out the noise-floor arm (engine = the trainer)")
    r.add_argument("--arms", default=None,
                   help="the arms instead of --modes x --seeds (+ floor): a preset (issue49: off / R2 / R3 / R3w x "
                        "seeds 0, 1, the floor, R2 / R3 at 1 and 8 mini-batches; small: off, R3, floor) or "
                        "comma-separated names <mode>[-mb<N>]-s<seed> | floor-s<seed>")
    r.add_argument("--steps", type=int, default=300, help="GRPO steps per arm")
    r.add_argument("--prompts", type=int, default=32, help="problems per step")
    r.add_argument("--group", type=int, default=8, help="samples per problem (GRPO group)")
    r.add_argument("--mini-batches", type=int, default=4, help="updates per rollout batch")
    r.add_argument("--lr", type=float, default=None, help="Adam learning rate of GRPO (default 1e-4)")
    r.add_argument("--trainer-dtype", choices=["bf16", "fp32"], default=None,
                   help="megatron trainer: bf16 params + fp32 main weights (default on cuda) or fp32 (cpu)")
    r.add_argument("--spec", choices=["local", "te"], default="local", help="trainer layer spec (te: cuda)")
    r.add_argument("--grpo-router-losses", type=float, default=0.0, metavar="SCALE",
                   help="the trainer keeps the warm start's load-balancing and z-loss during GRPO, times SCALE "
                        "(as megatron's moe_aux_loss_coeff / moe_z_loss_coeff): they hold the routers' margins "
                        "narrow, which GRPO alone widens; 1 overpowers GRPO's gradient on the routers "
                        "(docs/evidence.md); default 0: the GRPO loss alone")
    r.add_argument("--sft-steps", type=int, default=None,
                   help="warm-start steps at most (default 3000; it stops at 60%% greedy accuracy or after 150 s)")
    r.add_argument("--sft-batch", type=int, default=None, help="warm-start batch (default 256)")
    r.add_argument("--sft-seconds", type=float, default=None, help="warm-start time bound (default 150)")
    r.add_argument("--sft-target", type=float, default=None,
                   help="warm-start greedy accuracy at which it stops (default 0.6)")
    r.add_argument("--sft-lr", type=float, default=None, help="warm-start peak learning rate (default 3e-3)")
    r.add_argument("--aux-loss", type=float, default=None,
                   help="warm start's load-balancing loss coefficient (default 0.01; larger: flatter, narrower routers)")
    r.add_argument("--router-z-loss", type=float, default=None,
                   help="warm start's router z-loss coefficient per MoE layer (default 0: off)")
    # the model's and the task's options default to None: with --warm-start they come from the warm
    # start's spec.json, and one given that differs from it is refused
    r.add_argument("--max-digits", type=int, default=None, help="operand digits of the addition task (default 3)")
    r.add_argument("--partial-credit", type=float, default=None,
                   help="reward of a wrong answer per digit in place, as a fraction of the whole (default 0)")
    r.add_argument("--layers", type=int, default=None, help="(default 4)")
    r.add_argument("--experts", type=int, default=None, help="(default 8)")
    r.add_argument("--topk", type=int, default=None, help="experts per token (default 2)")
    r.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 16 (default 128)")
    r.add_argument("--moe-ffn", type=int, default=None, help="each expert's FFN size, a multiple of 16 (default 128)")
    r.add_argument("--dense-first", action="store_true", default=None, help="layer 0 dense, the others MoE")
    r.add_argument("--warm-start", default=None, metavar="DIR",
                   help="reuse this warm start folder (state.pt, stats.json, spec.json: e.g. an earlier session's "
                        "RUN/warmstart) instead of training one; the model and task are the ones it was trained "
                        "for (an option above that differs is refused); no calibration")
    r.add_argument("--calibrate", nargs="?", const="default", default=None, metavar="CANDIDATES",
                   help="first try candidate models side by side (comma-separated specs, see above; 'default': "
                        "the built-in list, cheapest first), then run the first whose route agreement is at most "
                        "--max-agreement and whose warm start reached its target (else the least-agreeing one)")
    r.add_argument("--max-agreement", type=float, default=0.95,
                   help="calibration: the most route agreement (trainer's own top-k vs engine's) a model may have")
    r.add_argument("--calib-wall-s", type=float, default=300.0, help="calibration's bound in seconds (within --wall-s)")
    r.add_argument("--calib-steps", type=int, default=2, help="GRPO steps of each candidate's calibration arm")
    r.add_argument("--calibrate-only", action="store_true", help="stop after the calibration (calibration.json)")
    r.add_argument("--side-by-side-factor", type=float, default=1.3,
                   help="calibration: an arm's step time among all the run's arms over its time in the calibration, "
                        "where a few candidates share the machine (the estimate a candidate's run must fit the time "
                        "left with; default 1.3)")
    r.add_argument("--procs", type=int, default=None,
                   help="arm processes (default: one per arm on cuda, one on cpu); arms share a process in turn")
    r.add_argument("--gpus", type=int, default=1, help="spread the arm processes over this many GPUs")
    r.add_argument("--wall-s", type=float, default=660.0,
                   help="hard bound on the whole run (calibration included) in seconds: no step starts that "
                        "would end after it")
    r.add_argument("--resume", action="store_true",
                   help="reuse OUT's warm start and continue each arm from its last checkpoint (a calibrated run: "
                        "on the model its calibration chose)")
    r.add_argument("--checkpoint-every", type=int, default=100, help="steps between an arm's checkpoints (0: none)")
    r.add_argument("--json", action="store_true", help="print each arm's status and steps as one JSON object")
    q = cmds.add_parser("plot", aliases=["report"], help="table and figure from the logs (.jsonl or .jsonl.gz) of "
                        "one run or of several (e.g. one per device session) that loaded the same warm start")
    q.add_argument("logs", nargs="+", help="run folder, its logs/, or a folder of <arm>.jsonl[.gz] with run.json "
                                           "beside them (collect's); several: their arms in one table")
    q.add_argument("--out", default="evidence.png", help="figure path ('' to skip)")
    q.add_argument("--warmup", type=int, default=50, help="steps left out of the table's means")
    q.add_argument("--window", type=int, default=10, help="running mean of the thick lines, in steps")
    q.add_argument("--title", default="")
    q.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    st = cmds.add_parser("status", help="a running run's arms: steps, route agreement of the last 20 steps, pace "
                         "against the run's wall")
    st.add_argument("run", help="the run folder (evidence run's --out)")
    st.add_argument("--json", action="store_true", help="one JSON list, an object per arm")
    return p


def run(args: argparse.Namespace) -> int:
    if args.evidence_command == "status":
        return _status(args)
    return _run(args) if args.evidence_command == "run" else _plot(args)


def _status(args: argparse.Namespace) -> int:
    from r3bridge.demo.evidence_report import progress, progress_lines

    arms = progress(args.run)
    if args.json:
        print_json(arms)
    else:
        print("\n".join(progress_lines(arms)) if arms else f"{args.run}: no arm has logged a step yet")
    return 0


def _run(args: argparse.Namespace) -> int:
    require("r3bridge evidence run", "demo", {"megatron.core": "megatron-core", "transformers": "transformers"})
    if args.engine == "vllm" and not installed("vllm"):
        raise CliError("--engine vllm needs vLLM importable (verl 0.9.1's pin: vllm==0.24.0); on a machine "
                       "without it use --engine hf")
    if args.spec == "te" and args.device != "cuda":
        raise CliError("--spec te needs --device cuda")
    if args.steps < 1 or args.wall_s <= 0 or args.calib_steps < 1 or args.calib_wall_s <= 0:
        raise CliError("--steps, --wall-s, --calib-steps and --calib-wall-s must be positive")
    if args.side_by_side_factor <= 0:
        raise CliError("--side-by-side-factor must be positive")
    if not 0.0 < args.max_agreement <= 1.0:
        raise CliError(f"--max-agreement must be in (0, 1], got {args.max_agreement}")
    if args.calibrate and args.resume:
        raise CliError("--calibrate and --resume exclude each other (a resumed run keeps its model)")
    if args.warm_start and (args.calibrate or args.resume):
        raise CliError("--warm-start excludes --calibrate and --resume (the warm start fixes the model)")
    training = [f"--{k.replace('_', '-')}" for k in ("sft_steps", "sft_batch", "sft_seconds", "sft_target", "sft_lr",
                                                      "aux_loss", "router_z_loss") if getattr(args, k) is not None]
    if args.warm_start and training:
        raise CliError(f"{', '.join(training)}: no effect with --warm-start (its warm start is already trained; "
                       "spec.json says with what)")
    import time

    from r3bridge.demo import evidence
    from r3bridge.demo.evidence_config import (
        DEFAULT_CANDIDATES,
        GRPOOptions,
        RunConfig,
        arms_from_spec,
        make_arms,
        parse_candidate,
    )
    from r3bridge.demo.task import AdditionTask
    from r3bridge.demo.warmstart import EvidenceModelShape, WarmStartOptions

    t0 = time.time()
    cuda = args.device == "cuda"
    given_shape = {k: getattr(args, k) for k in SHAPE_OPTIONS if getattr(args, k) is not None}
    given_task = {k: getattr(args, k) for k in TASK_OPTIONS if getattr(args, k) is not None}
    warm_spec = _warm_start_spec(Path(args.warm_start), given_shape, given_task) if args.warm_start else None
    try:
        if warm_spec is not None:
            shape = EvidenceModelShape(**warm_spec["shape"])
            warm = WarmStartOptions(**warm_spec["warm"])
            task = AdditionTask(**warm_spec["task"])
        else:
            shape = EvidenceModelShape(**given_shape)
            warm = WarmStartOptions(**{k: v for k, v in (("steps", args.sft_steps), ("batch", args.sft_batch),
                                                         ("max_seconds", args.sft_seconds),
                                                         ("target_accuracy", args.sft_target), ("lr", args.sft_lr),
                                                         ("aux_loss", args.aux_loss),
                                                         ("router_z_loss", args.router_z_loss)) if v is not None})
            task = AdditionTask(**given_task)
        candidates = []
        if args.calibrate:
            specs = DEFAULT_CANDIDATES if args.calibrate == "default" else args.calibrate.split(",")
            candidates = [parse_candidate(c, shape, warm) for c in specs if c.strip()]
            if len({c.name for c in candidates}) != len(candidates):
                raise ValueError(f"--calibrate {args.calibrate!r}: a candidate is named twice")
        biggest = max([shape, *(c.shape for c in candidates)], key=lambda s: s.layers)
        grpo = GRPOOptions(steps=args.steps, prompts=args.prompts, group=args.group, mini_batches=args.mini_batches,
                           device=args.device, trainer_dtype=args.trainer_dtype or ("bf16" if cuda else "fp32"),
                           layer_spec=args.spec, checkpoint_every=args.checkpoint_every,
                           router_losses=args.grpo_router_losses,
                           vllm_kv_cache_mb=_kv_cache_mb(biggest, args.prompts * args.group,
                                                         task.max_prompt_len + task.max_response_len),
                           **({} if args.lr is None else {"lr": args.lr}))
        arms = (arms_from_spec(args.arms, args.engine) if args.arms
                else make_arms(args.modes, args.seeds, args.engine, not args.no_floor))
        cfg = RunConfig(shape=shape, task=task, warm=warm, grpo=grpo, arms=arms, resume=args.resume)
    except ValueError as e:
        raise CliError(str(e)) from None
    root = Path(args.out)
    warm_from = Path(args.warm_start) if args.warm_start else None
    if args.resume and (root / "calibration.json").exists():
        # a calibrated run resumes on the model its calibration chose (its warm start is in OUT)
        chosen_name = json.loads((root / "calibration.json").read_text())["chosen"]
        chosen = parse_candidate(chosen_name, shape, warm)
        cfg.shape, cfg.warm, cfg.grpo = chosen.shape, chosen.warm(cfg.warm), chosen.grpo(cfg.grpo)
        print(f"[evidence] --resume: the calibration's choice {chosen_name} (OUT/calibration.json)", file=sys.stderr)
    if candidates:
        root.mkdir(parents=True, exist_ok=True)
        calib = evidence.calibrate(root, cfg, candidates, device=args.device, max_agreement=args.max_agreement,
                                   wall_s=min(args.calib_wall_s, args.wall_s), steps=args.calib_steps,
                                   run_deadline=t0 + args.wall_s, side_by_side=args.side_by_side_factor)
        if args.calibrate_only:
            if args.json:
                print_json(calib)
            return 0
        chosen = next(c for c in candidates if c.name == calib["chosen"])
        cfg.shape, cfg.warm, cfg.grpo = chosen.shape, chosen.warm(cfg.warm), chosen.grpo(cfg.grpo)
        warm_from = root / "calib" / chosen.name / "warmstart"
    left = args.wall_s - (time.time() - t0)
    if left <= 30:
        raise CliError(f"no time left for the run after the calibration ({left:.0f} s of --wall-s {args.wall_s:.0f})")
    procs = args.procs or (len(cfg.arms) if cuda else 1)
    summary = evidence.run(root, cfg, device=args.device, procs=procs, gpus=args.gpus, wall_s=left,
                           warm_from=warm_from)
    if args.json:
        print_json(summary)
    return 0 if all(s["steps"] for s in summary.values()) else 1


SHAPE_OPTIONS = ("layers", "experts", "topk", "hidden", "moe_ffn", "dense_first")
TASK_OPTIONS = ("max_digits", "partial_credit")


def _warm_start_spec(folder: Path, given_shape: dict, given_task: dict) -> dict:
    """``--warm-start``'s spec.json, checked; an option given that differs from what the warm start
    was trained for is refused, naming it."""
    from r3bridge.demo.evidence_config import EvidenceError, mismatches, read_warm_start

    try:
        spec = read_warm_start(folder)
    except (EvidenceError, OSError, json.JSONDecodeError, KeyError) as e:
        raise CliError(f"--warm-start: {e}") from None
    bad = mismatches(given_shape, spec["shape"], "shape") + mismatches(given_task, spec["task"], "task")
    if bad:
        raise CliError(f"--warm-start {folder} was trained for another model or task: {'; '.join(bad)} "
                       "(given vs the warm start's; leave these options out to take the warm start's)")
    return spec


def _kv_cache_mb(shape, samples: int, max_len: int) -> int:
    """vLLM's fixed KV cache for one step's samples at full length, twice over (at least 64 MB)."""
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2          # K and V, bf16
    return max(64, -(-2 * per_token * samples * max_len // (1 << 20)))


def _plot(args: argparse.Namespace) -> int:
    from r3bridge.demo.evidence_config import EvidenceError
    from r3bridge.demo.evidence_report import (
        METRICS,
        calibration_table,
        curves,
        load_calibration,
        load_runs,
        runs_table,
        summarize,
        table,
    )

    try:
        arms, runs = load_runs(args.logs)
    except (FileNotFoundError, json.JSONDecodeError, KeyError, EvidenceError) as e:
        raise CliError(f"{' '.join(args.logs)}: {e}") from None
    summary = summarize(arms, args.warmup)
    calib = next((c for c in map(load_calibration, args.logs) if c is not None), None)
    if args.out:
        plt = pyplot()
        cols = 3
        fig, axes = plt.subplots(-(-len(METRICS) // cols), cols, figsize=(5.2 * cols, 3.3 * -(-len(METRICS) // cols)))
        for ax, (key, label, _, log) in zip(axes.flat, METRICS):
            for group, c in curves(arms, key, log=log, window=args.window).items():
                color = COLORS.get(group)
                style = "--" if "-mb" in group else "-"        # the 1 / 8 mini-batch arms dashed
                for xs, ys in c["seeds"].values():
                    ax.plot(xs, ys, color=color, lw=0.5, alpha=0.35, ls=style)
                ax.plot(*c["mean"], color=color, lw=2, ls=style, label=f"{group} ({c['members']} seed(s))")
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("GRPO step")
            ax.set_yscale("log" if log else "linear")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(METRICS):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=8)
        if args.title:
            fig.suptitle(args.title)
        fig.tight_layout()
        save_figure(fig, args.out)
    if args.json:
        if args.out:
            summary["plot"] = args.out
        if calib is not None:
            summary["calibration"] = calib
        summary["runs"] = runs
        print_json(summary)
    else:
        if calib is not None:
            print("Calibration (candidates side by side, one short off arm each):\n\n" + calibration_table(calib) + "\n")
        print("Runs (the arms' warm start and commit):\n\n" + runs_table(runs) + "\n")
        print(table(summary))
        if args.out:
            print(f"wrote {args.out}", file=sys.stderr)
    return 0
