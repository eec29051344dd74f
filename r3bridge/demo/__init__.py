"""The demo's job: `r3bridge demo`'s rollout engine and its trainer loop (product code).

* ``hf_engine``   - a HuggingFace transformers MoE model as the rollout engine: ``generate()``
                    with routes reported exactly as vLLM / SGLang report them
* ``hf_to_mcore`` - the same weights converted into a megatron-core GPT-MoE (the trainer)
* ``job``         - the tiny asynchronous-RL loop run once per replay mode, one process per rank

``r3bridge evidence`` (docs/evidence.md), a GRPO run per replay mode and seed:

* ``task``            - generated additions, their tokenizer and reward
* ``warmstart``       - the tiny Qwen3-MoE and its supervised warm start
* ``evidence_config`` - the run's options and arms (``run.json``)
* ``grpo``            - one arm: GRPO steps with a real engine, logged per step
* ``vllm_engine``     - vLLM in-process as the engine, weights synced as verl syncs them
* ``evidence``        - the orchestrator: warm start, arm processes, the wall-clock bound
* ``evidence_report`` - the logs read back: the table and the figure's curves

Needs the ``demo`` extra (megatron-core + transformers); ``r3bridge demo`` checks that before
it spawns a rank. The CPU ranks run on the adapter author's harness (:mod:`r3bridge.testing`).
"""
