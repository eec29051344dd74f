"""Everything a CPU rehearsal of verl's launch line reads, written into one folder (test lab).

    python /path/to/r3bridge/testlab/verl_cpu_job.py [FOLDER]      # default: the current folder
    . FOLDER/cpu.env
    python -m r3bridge.adapters.verl.main_ppo --config-name=ppo_megatron_trainer ...   (docs/use-with-verl.md)

The launch itself is the user's: verl's launcher through r3bridge's (``main_ppo``), Ray, verl's
TransferQueue, V1 trainer, agent loop and reward workers, compute_log_prob, reference, GRPO update.
What a CPU cannot run is stood in for by ``testlab`` modules the command line and ``cpu.env`` name:

* the rollout engine: vLLM / SGLang cannot run here; ``actor_rollout_ref.rollout.name=hf_r3`` is
  r3bridge's HF transformers engine, reporting routes exactly as vLLM does
  (:mod:`testlab.verl_hf_rollout`);
* no GPU, no Transformer Engine: verl's NVIDIA platform with gloo (``cpu.env``:
  ``VERL_USE_EXTERNAL_MODULES=testlab.verl_e2e_platform``, ``VERL_PLATFORM=r3bridge_cpu``) and the
  harness's CPU shims and TE-free model bridge (``actor_rollout_ref.model.external_lib=testlab.verl_e2e_worker``).

Written here: ``model/`` (a tiny first-layer-dense Qwen3-MoE's ``config.json`` and a word-level
Qwen-style tokenizer), ``train.parquet`` (8 prompts; 4 of them go through the tool agent loop with
r3bridge's first-seen stitching), ``reward.py``, ``agent_loops.yaml``, ``tools.yaml``
(:func:`testlab.verl_e2e.write_job`), ``lab/testlab`` (a link to this checkout's ``testlab``: the only
thing ``cpu.env`` puts on ``PYTHONPATH``, so the r3bridge the job imports is the installed one, never
the checkout's folder) and ``cpu.env``.
"""
from __future__ import annotations

import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_FILE = "cpu.env"


def write(folder: str) -> dict[str, str]:
    from testlab.verl_e2e import stand_in_env, write_job

    # R3E2E_FIRST_SEEN=0: the tool agent loop keeps the last call's routes (verl 0.9.1's own
    # behaviour), the control run of tests/adapters/test_verl_e2e.py
    paths = write_job(folder, first_seen=os.environ.get("R3E2E_FIRST_SEEN", "1") != "0")
    with open(os.path.join(paths["root"], ENV_FILE), "w") as f:
        f.write("# the CPU stand-ins of a verl job (testlab/verl_cpu_job.py); a GPU job needs none of this\n")
        for k, v in stand_in_env(paths).items():
            f.write(f"export {k}={shlex.quote(v)}\n")
    return paths


def main(argv: list[str]) -> int:
    folder = argv[0] if argv else "."
    write(folder)
    print(f"verl_cpu_job: wrote model/, train.parquet, reward.py, agent_loops.yaml, tools.yaml, lab/ and "
          f"{ENV_FILE} in {os.path.abspath(folder)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path[0:1] = []          # this folder: testlab's modules are imported as testlab.*
    sys.path.append(ROOT)       # after site-packages: an installed r3bridge wins over the checkout's
    sys.exit(main(sys.argv[1:]))
