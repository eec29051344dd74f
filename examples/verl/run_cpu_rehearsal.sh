#!/usr/bin/env bash
# verl's launch line rehearsed on CPU (docs/use-with-verl.md, "Rehearse on CPU"): r3bridge's launcher,
# Ray, verl's TransferQueue, V1 trainer, agent loop (two prompts of each step through the tool agent
# loop with r3bridge's first-seen stitching), reward, compute_log_prob, reference, GRPO update, 2 steps
# of 4 prompts x 2 samples, R3 with route traces; then `r3bridge inspect` on the traces.
#
#   cd "$(mktemp -d)" && bash "$R3BRIDGE/examples/verl/run_cpu_rehearsal.sh" [more verl / r3bridge overrides]
#
# The job's files go into the current folder (testlab/verl_cpu_job.py: a tiny first-layer-dense
# Qwen3-MoE, 8 prompts, a reward function, cpu.env). What stands in for what a CPU cannot run is the
# second block of overrides below and cpu.env: the rollout engine (r3bridge's HF transformers engine
# as verl rollout backend `hf_r3`, reporting routes as vLLM does), verl's NVIDIA platform with gloo,
# the CPU harness's TE-free model bridge (mbridge, hence vanilla_mbridge=True), one logical GPU,
# 8 CPU slots and no dashboard for Ray (its ten processes slow a 2-core start), one TransferQueue
# storage unit. The first and last blocks are an ordinary
# verl 0.9 GRPO job and r3bridge's two settings.
set -euo pipefail
R3BRIDGE=${R3BRIDGE:-$(cd "$(dirname "$0")/../.." && pwd)}
JOB=$PWD

python "$R3BRIDGE/testlab/verl_cpu_job.py" "$JOB"
. "$JOB/cpu.env"

python -m r3bridge.adapters.verl.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo trainer.total_training_steps=2 trainer.val_before_train=False \
    trainer.save_freq=-1 trainer.logger='[console,file]' reward.custom_reward_function.path="$JOB/reward.py" \
    data.train_files="$JOB/train.parquet" data.val_files="$JOB/train.parquet" data.train_batch_size=4 \
    data.max_prompt_length=24 data.max_response_length=40 data.dataloader_num_workers=0 data.shuffle=False \
    actor_rollout_ref.model.path="$JOB/model" actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160 \
    actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.n=2 \
    actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.agent.num_workers=1 reward.num_workers=1 \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$JOB/agent_loops.yaml" \
    actor_rollout_ref.rollout.multi_turn.format=r3e2e actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$JOB/tools.yaml" \
    \
    actor_rollout_ref.rollout.name=hf_r3 actor_rollout_ref.model.external_lib=testlab.verl_e2e_worker \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=True \
    actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=auto \
    trainer.n_gpus_per_node=1 +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=8 \
    +ray_kwargs.ray_init.include_dashboard=False transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
    \
    r3bridge.replay_mode=R3 actor_rollout_ref.rollout.enable_rollout_routing_replay=True \
    r3bridge.trace_dir="$JOB/routes" \
    "$@"

# what the routers replayed and would have chosen natively, per step, pass and layer (replay on)
if [ -d "$JOB/routes" ]; then r3bridge inspect "$JOB/routes"; fi
