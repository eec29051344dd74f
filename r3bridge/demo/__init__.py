"""The demo's job: `r3bridge demo`'s rollout engine and its trainer loop (product code).

* ``hf_engine``   - a HuggingFace transformers MoE model as the rollout engine: ``generate()``
                    with routes reported exactly as vLLM / SGLang report them
* ``hf_to_mcore`` - the same weights converted into a megatron-core GPT-MoE (the trainer)
* ``job``         - the tiny asynchronous-RL loop run once per replay mode, one process per rank

Needs the ``demo`` extra (megatron-core + transformers); ``r3bridge demo`` checks that before
it spawns a rank. The CPU ranks run on the adapter author's harness (:mod:`r3bridge.testing`).
"""
