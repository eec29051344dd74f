"""Stands in for ``python`` / ``python3`` when tests run a guide's shell command lines.

verl's guide ends in a launch that needs GPUs and a cluster. This runs the same command line up to
that point, with r3bridge's and verl's own code: the entry point is run as the command names it (from
whatever folder the shell is in), the command line is composed by verl's hydra config, r3bridge's
section is resolved and validated. Then it prints ``GUIDE-OK <what>`` and exits instead of starting
the cluster. (SkyRL's and AReaL's guide commands run as written, with the real interpreter: r3bridge's
launchers for them stop by themselves, in one line, where this machine cannot go on.)

    python testlab/guide_dry_run.py -m r3bridge.adapters.verl.main_ppo <verl overrides>
"""
from __future__ import annotations

import os
import subprocess
import sys

MOE_HF = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
          "mlp_only_layers": []}


def verl(argv: list[str]) -> str:
    import verl.trainer.main_ppo as verl_main
    from hydra import compose, initialize_config_dir

    from r3bridge.adapters.verl.config import validate_verl_config
    from r3bridge.adapters.verl.main_ppo import section_overrides

    # the launcher itself, with hydra's --cfg job: it composes the config and prints it
    out = subprocess.run([sys.executable, "-m", "r3bridge.adapters.verl.main_ppo", *argv, "--cfg", "job"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"launcher failed:\n{out.stderr[-3000:]}")
    names = [a.split("=", 1)[1] for a in argv if a.startswith("--config-name=")]
    overrides = [a for a in argv if not a.startswith("--")]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl_main.__file__), "config"),
                               version_base=None):
        cfg = compose(config_name=names[0] if names else "ppo_trainer", overrides=section_overrides(overrides))
    rc = validate_verl_config(cfg, hf_config=MOE_HF)         # the launcher's validation (model: a tiny MoE)
    return f"verl replay_mode={rc.replay_mode.value}"


def main() -> None:
    args = sys.argv[1:]
    if args[:1] != ["-m"]:
        raise SystemExit(f"guide_dry_run: expected -m MODULE, got {args}")
    module, rest = args[1], args[2:]
    run = {"r3bridge.adapters.verl.main_ppo": verl}.get(module)
    if run is None:
        raise SystemExit(f"guide_dry_run: no dry run for {module}")
    print(f"GUIDE-OK {run(rest)}", flush=True)


if __name__ == "__main__":
    main()
