"""Stands in for ``python`` / ``python3`` when tests run a guide's shell command lines.

Each guide ends in a launch that needs GPUs and a cluster (Ray, SGLang, vLLM). This runs the same
command line up to that point, with r3bridge's and the framework's own code: the entry point is
imported as the command names it (from whatever folder the shell is in), the command line is parsed
by the framework's own parser, r3bridge's section is resolved and validated, and the framework's own
config checks run. Then it prints ``GUIDE-OK <what>`` and exits instead of starting the cluster.

    python testlab/guide_dry_run.py -m r3bridge.adapters.skyrl.main <SkyRL overrides>
    python testlab/guide_dry_run.py -m r3bridge.adapters.verl.main_ppo <verl overrides>
    python testlab/guide_dry_run.py -m areal.infra.launcher.local SCRIPT --config YAML <overrides>
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

MOE_HF = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
          "mlp_only_layers": []}


def skyrl(argv: list[str]) -> str:
    from r3bridge.adapters.skyrl.main import config_from_argv  # everything main() does before Ray
    cfg = config_from_argv(argv)
    return f"skyrl replay_mode={cfg.trainer.r3bridge.replay_mode.value}"


def verl(argv: list[str]) -> str:
    import verl.trainer.main_ppo as verl_main
    from hydra import compose, initialize_config_dir

    from r3bridge.adapters.verl.config import validate_verl_config
    from r3bridge.adapters.verl.main_ppo import rewrite_overrides

    # the launcher itself, with hydra's --cfg job: it composes the config and prints it
    out = subprocess.run([sys.executable, "-m", "r3bridge.adapters.verl.main_ppo", *argv, "--cfg", "job"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"launcher failed:\n{out.stderr[-3000:]}")
    names = [a.split("=", 1)[1] for a in argv if a.startswith("--config-name=")]
    overrides = [a for a in argv if not a.startswith("--")]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl_main.__file__), "config"),
                               version_base=None):
        cfg = compose(config_name=names[0] if names else "ppo_trainer", overrides=rewrite_overrides(overrides))
    rc = validate_verl_config(cfg, hf_config=MOE_HF)         # the launcher's validation (model: a tiny MoE)
    return f"verl replay_mode={rc.replay_mode.value}"


def areal(argv: list[str]) -> str:
    from r3bridge.adapters.areal.config import parse_cli, section_of

    script = argv[0]
    spec = importlib.util.spec_from_file_location("guide_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)                          # the example imports as AReaL's launcher runs it
    cfg = parse_cli(argv)                                    # AReaL's own parser, as load_expr_config
    section = section_of(cfg)
    return f"areal replay_mode={section.replay_mode.value if section else 'unset'}"


def main() -> None:
    args = sys.argv[1:]
    if args[:1] != ["-m"]:
        raise SystemExit(f"guide_dry_run: expected -m MODULE, got {args}")
    module, rest = args[1], args[2:]
    run = {"r3bridge.adapters.skyrl.main": skyrl, "r3bridge.adapters.verl.main_ppo": verl,
           "areal.infra.launcher.local": areal}.get(module)
    if run is None:
        raise SystemExit(f"guide_dry_run: no dry run for {module}")
    print(f"GUIDE-OK {run(rest)}", flush=True)


if __name__ == "__main__":
    main()
