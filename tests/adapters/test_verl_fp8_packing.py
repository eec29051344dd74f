"""verl's FP8 THD packing reaches r3bridge as the trainer's own ``cu_seqlens_padded``.

verl 0.9.1 pads FP8 micro-batches itself (``preprocess_thd_engine(use_fp8_padding=True)``:
sequences to ``lcm(16, align)``, the micro-batch to ``align * 128``). r3bridge no longer guesses
that rule from ``config.fp8`` (``ParallelLayout.from_megatron``): the verl adapter passes verl's
real padded offsets, so the plan must equal verl's packing with FP8 and without.
"""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from r3bridge import ParallelLayout, ReplayBatch, shard
from r3bridge.parallel.packing import PackPlan


@contextlib.contextmanager
def _parallel_state(tp: int, cp: int):
    """megatron's parallel_state getters that verl's packer reads, without a process group."""
    from megatron.core import parallel_state as ps

    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(ps, "get_tensor_model_parallel_world_size", return_value=tp))
        st.enter_context(mock.patch.object(ps, "get_context_parallel_world_size", return_value=cp))
        st.enter_context(mock.patch.object(ps, "get_context_parallel_rank", return_value=0))
        yield


@pytest.mark.parametrize("fp8", [None, "hybrid", "e4m3"])
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (2, 2)])
def test_verl_adapter_plan_is_verls_fp8_packing(fp8, tp, cp):
    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine

    seq_lens = [200, 300, 108]
    offsets = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    input_ids = torch.nested.nested_tensor_from_jagged(torch.arange(sum(seq_lens)), offsets=offsets)
    config = SimpleNamespace(fp8=fp8, num_layers=1, moe_layer_freq=1, tensor_model_parallel_size=tp,
                             context_parallel_size=cp, sequence_parallel=tp > 1)
    model = SimpleNamespace(config=config)
    engine = SimpleNamespace(_get_context_parallel_layout=R3BridgeMegatronEngine._get_context_parallel_layout)
    with _parallel_state(tp, cp):
        cu = R3BridgeMegatronEngine.r3_cu_seqlens_padded(engine, input_ids, model).to(torch.int64)
    padded = (cu[1:] - cu[:-1]).tolist()
    align = tp * cp * 2 if cp > 1 else tp
    if fp8:   # verl's FP8 rule: per sequence lcm(16, align), the whole micro-batch to align * 128
        assert all(p % math.lcm(16, align) == 0 for p in padded[:-1])
        assert sum(padded) % (align * 128) == 0
    else:
        assert padded == [-(-n // align) * align for n in seq_lens]
    # the layout read from the model config carries no FP8 guess; verl's offsets make the plan
    layout = ParallelLayout.from_megatron(config)
    assert layout.fp8 is False
    plan = PackPlan.build(layout, seq_lens, cu_seqlens_padded=cu)
    assert plan.padded_lens.tolist() == padded
    # ... and it is the explicit FP8 rule where verl used it
    assert PackPlan.build(ParallelLayout.from_megatron(config, fp8=bool(fp8)), seq_lens).padded_lens.tolist() == padded
    # every router row of the rank is planned: SP splits the CP-local rows over tp
    routes = ReplayBatch.from_ragged([torch.zeros((n, 1, 2), dtype=torch.int64) + torch.tensor([0, 1])
                                      for n in seq_lens], num_experts=4, layer_ids=[0], engine="vllm")
    t = shard(routes, layout, seq_lens, cu_seqlens_padded=cu, tp_rank=0, cp_rank=0)
    assert t.num_rows == sum(padded) // cp // (tp if layout.sequence_parallel else 1)
