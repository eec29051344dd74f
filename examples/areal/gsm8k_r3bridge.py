"""AReaL 1.0 GRPO on GSM8K with r3bridge (SPMD launch, Megatron actor, SGLang rollout).

    python3 -m r3bridge.adapters.areal.launch "$R3BRIDGE/examples/areal/gsm8k_r3bridge.py" \
        --config "$R3BRIDGE/examples/areal/gsm8k_megatron.yaml" [r3bridge.replay_mode=R2 ...]

(r3bridge's launcher: AReaL's local launcher, unchanged, after r3bridge's checks; from any folder,
relative paths being the current folder's.)

Differences from AReaL's own GSM8K example, all marked ``r3bridge``: the config class (AReaL's
``GRPOConfig`` plus the ``r3bridge:`` section), the trainer class, the workflow class, and (R3)
``rollout.return_routed_experts: true`` in the config.
"""
from __future__ import annotations

import sys

from r3bridge.adapters.areal import grpo_config_class, trainer_class, workflow_class
from r3bridge.adapters.areal._compat import import_areal

cli_args = import_areal("areal.api.cli_args")
rlvr = import_areal("areal.workflow.rlvr")


def main(argv: list[str]) -> None:
    config, _ = cli_args.load_expr_config(argv, grpo_config_class())       # r3bridge: the r3bridge: section
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset(split="train", dataset_config=config.train_dataset, tokenizer=tokenizer)

    Trainer = trainer_class()                     # r3bridge: actor engine + PPO actor, reads config.r3bridge
    Workflow = workflow_class(rlvr.RLVRWorkflow, config.actor.path)      # r3bridge: routes per trajectory
    with Trainer(config, train_dataset=train) as trainer:
        trainer.train(workflow=Workflow, workflow_kwargs=dict(reward_fn="areal.reward.gsm8k.gsm8k_reward_fn", gconfig=config.gconfig,
                                                              tokenizer=config.tokenizer_path))


if __name__ == "__main__":
    main(sys.argv[1:])
