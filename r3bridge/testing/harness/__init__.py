"""The CPU Megatron harness: real megatron-core GPT+MoE models on gloo ranks, the CUDA-call shims
they need without a GPU, packed batches, the schedule and a router-call probe. Modules are imported
one by one (``r3bridge.testing`` lists them); nothing is imported here, so the package stays
megatron-free until a rank needs it."""
