# Shared settings of the Qwen3-30B-A3B-class examples (1 node, 8 x H100/H200 80+ GB).
# Sourced by run_qwen3_30b_a3b_r3.sh and run_qwen3_30b_a3b_r2.sh; every value can be overridden
# from the environment. These are verl 0.9's documented Megatron + vLLM overrides (its own
# examples/router_replay/run_qwen30_a3b_megatron_vllm.sh), minus verl's router_replay switch.

HF_MODEL_PATH=${HF_MODEL_PATH:?set HF_MODEL_PATH to a local Qwen3-30B-A3B checkout}
TRAIN_DATA_PATH=${TRAIN_DATA_PATH:?set TRAIN_DATA_PATH (verl parquet, e.g. gsm8k/train.parquet)}
TEST_DATA_PATH=${TEST_DATA_PATH:-$TRAIN_DATA_PATH}
NODES=${NODES:-1}
GPUS=${GPUS:-8}
TP=${TP:-2} PP=${PP:-1} EP=${EP:-8} ETP=${ETP:-1}
INFER_TP=${INFER_TP:-2}
OFFLOAD=${OFFLOAD:-True}
BS=${BS:-64}                       # prompts per step
N=${N:-8}                          # responses per prompt
MINI_BS=${MINI_BS:-16}             # BS / MINI_BS = 4 mini-batches per step: off-policy, where replay matters
MAX_PROMPT=${MAX_PROMPT:-1024}
MAX_RESPONSE=${MAX_RESPONSE:-2048}
TOKENS_PER_GPU=$(( (MAX_PROMPT + MAX_RESPONSE) * 2 ))

export CUDA_DEVICE_MAX_CONNECTIONS=1
export HYDRA_FULL_ERROR=1

COMMON_ARGS=(
    --config-name=ppo_megatron_trainer
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$TRAIN_DATA_PATH"
    data.val_files="$TEST_DATA_PATH"
    data.train_batch_size=$BS
    data.max_prompt_length=$MAX_PROMPT
    data.max_response_length=$MAX_RESPONSE
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$HF_MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BS
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOKENS_PER_GPU
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TP
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$PP
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=$EP
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=$ETP
    actor_rollout_ref.actor.megatron.param_offload=$OFFLOAD
    actor_rollout_ref.actor.megatron.optimizer_offload=$OFFLOAD
    # verl's own replay stays off: r3bridge replays (two replays at once is refused)
    actor_rollout_ref.actor.megatron.router_replay.mode=disabled
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.n=$N
    actor_rollout_ref.rollout.tensor_model_parallel_size=$INFER_TP
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.calculate_log_probs=True      # rollout log-probs: r3bridge's mismatch metrics
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$TOKENS_PER_GPU
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=$TP
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=$PP
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=$EP
    actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=$ETP
    actor_rollout_ref.ref.megatron.param_offload=$OFFLOAD
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$TOKENS_PER_GPU
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name=r3bridge_verl
    trainer.nnodes=$NODES
    trainer.n_gpus_per_node=$GPUS
    trainer.save_freq=-1
    trainer.test_freq=-1
    trainer.val_before_train=False
    trainer.total_training_steps=${STEPS:-200}
)
