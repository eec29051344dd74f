"""The layer axis of engine routes is stated, never guessed from its length (r3bridge.layer_axis),
and TensorRT-LLM's MoE-only format (TensorRT-LLM #18397, RFC #17778) is read by
``ReplayBatch.from_trtllm``.

The model here is dense-first, as DeepSeek-V3 / Moonlight: 6 decoder layers, 0 and 1 dense, so
vLLM / SGLang send 6 layers and TensorRT-LLM sends 4."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from r3bridge import (
    ConfigError,
    LayerMappingError,
    ParallelLayout,
    PayloadError,
    ReplayBatch,
    RouteValueError,
    shard,
    unshard,
)
from r3bridge.config import ReplayConfig
from r3bridge.engines.decoders import moe_layers_of

from ._reference import random_routes

HIDDEN, MOE, K, E = 6, [2, 3, 4, 5], 2, 16
FREQ = [0, 0, 1, 1, 1, 1]


class TrtllmOutput:
    """TensorRT-LLM can't run here: a stand-in with its documented ``CompletionOutput.routed_experts``:
    ``(seq_len - 1, num_moe_layers, top_k)`` per request, pre-EPLB logical expert ids."""

    def __init__(self, routed_experts):
        self.routed_experts = routed_experts


def _moe_only(rng, prompt: int, generated: int) -> np.ndarray:
    # seq_len = prompt + generated tokens; the last one was never fed forward: no row
    return random_routes(rng, prompt + generated - 1, len(MOE), K, E).astype(np.int32)


def test_trtllm_rows_are_moe_layers_in_order():
    rng = np.random.default_rng(0)
    a, b = _moe_only(rng, 5, 4), _moe_only(rng, 3, 7)
    rb = ReplayBatch.from_trtllm([TrtllmOutput(a), b], num_experts=E, moe_layer_ids=MOE)
    assert rb.layer_ids == tuple(MOE) and rb.topk == K and rb.rows_per_seq == [8, 9]
    assert np.array_equal(rb.sequence(0)[0].numpy(), a) and np.array_equal(rb.sequence(1)[0].numpy(), b)
    assert rb.engine == "trtllm"
    # the same routes from an all-hidden engine (zero rows in the dense layers) give the same batch
    wide = np.zeros((a.shape[0], HIDDEN, K), dtype=np.int32)
    wide[:, MOE] = a
    assert torch.equal(ReplayBatch.from_vllm([wide], num_experts=E, moe_layer_ids=MOE).routes,
                       ReplayBatch.from_trtllm([a], num_experts=E, moe_layer_ids=MOE).routes)


def test_trtllm_refuses_an_all_hidden_axis_and_missing_routes():
    rng = np.random.default_rng(1)
    wide = random_routes(rng, 6, HIDDEN, K, E).astype(np.int32)
    with pytest.raises(LayerMappingError, match=r"6 layers, layer_axis='moe_only' expects one per MoE layer: 4"):
        ReplayBatch.from_trtllm([wide], num_experts=E, moe_layer_ids=MOE)
    with pytest.raises(LayerMappingError, match="needs moe_layer_ids"):
        ReplayBatch.from_trtllm([wide], num_experts=E, moe_layer_ids=None)
    with pytest.raises(PayloadError, match="sequence 1: TensorRT-LLM returned no routed_experts"):
        ReplayBatch.from_trtllm([_moe_only(rng, 2, 2), TrtllmOutput(None)], num_experts=E, moe_layer_ids=MOE)


def test_moe_only_routes_given_as_all_hidden_are_refused_not_guessed():
    """A MoE-only payload handed to an all-hidden reader (vLLM's, SGLang's) never lands on other
    layers: the error names the axis to set."""
    rng = np.random.default_rng(2)
    a = _moe_only(rng, 4, 4)
    with pytest.raises(LayerMappingError, match="out of range for 4 reported layers"):
        ReplayBatch.from_vllm([a], num_experts=E, moe_layer_ids=MOE)
    ok = ReplayBatch.from_vllm([a], num_experts=E, moe_layer_ids=MOE, layer_axis="moe_only")
    assert ok.layer_ids == tuple(MOE) and np.array_equal(ok.routes.numpy(), a)
    meta = {"routed_experts": base64.b64encode(a.tobytes()), "prompt_tokens": 4, "completion_tokens": 4}
    sg = ReplayBatch.from_sglang([meta], num_experts=E, num_layers=len(MOE), topk=K, moe_layer_ids=MOE,
                                 layer_axis="moe_only")
    assert torch.equal(sg.routes, ok.routes)
    # routing weights (SGLang #23999) follow the same axis as the ids
    w = np.random.default_rng(5).random(a.shape).astype("<f4")
    meta["routed_experts_weights"] = base64.b64encode(w.tobytes()).decode()
    sgw = ReplayBatch.from_sglang([meta], num_experts=E, num_layers=len(MOE), topk=K, moe_layer_ids=MOE,
                                  layer_axis="moe_only")
    assert sgw.weights is not None and tuple(sgw.weights.shape) == a.shape
    vw = ReplayBatch.from_vllm([a], num_experts=E, moe_layer_ids=MOE, layer_axis="moe_only", weights=[w])
    assert torch.equal(vw.weights, sgw.weights)


@pytest.mark.parametrize("hidden", [HIDDEN, None])
def test_an_unstated_axis_whose_length_fits_both_readings_is_refused(hidden):
    routes = torch.zeros(3, len(MOE), K, dtype=torch.int32)      # one entry per MoE layer
    with pytest.raises(LayerMappingError, match="set layer_axis='moe_only'.*does not guess"):
        moe_layers_of(routes, MOE, layer_dim=1, num_hidden_layers=hidden)
    # stated, the same tensor is read
    assert moe_layers_of(routes, MOE, layer_dim=1, num_hidden_layers=hidden, layer_axis="moe_only") is routes
    with pytest.raises(LayerMappingError, match="needs layer_axis='moe_only'"):
        moe_layers_of(routes, MOE, layer_dim=1, num_hidden_layers=HIDDEN, layer_axis="all_hidden")


def test_an_unstated_axis_is_read_only_where_one_reading_fits():
    wide = torch.arange(HIDDEN).view(1, HIDDEN, 1).expand(2, HIDDEN, K)
    assert moe_layers_of(wide, MOE, layer_dim=1, num_hidden_layers=HIDDEN)[0, :, 0].tolist() == MOE
    # every layer MoE: the two readings are the same layers
    assert moe_layers_of(wide, list(range(HIDDEN)), layer_dim=1, num_hidden_layers=HIDDEN) is wide
    # MoE-first model (layers 0, 1 of 4): a 2-layer axis is MoE-only, a fact the caller must state
    with pytest.raises(LayerMappingError, match="set layer_axis"):
        moe_layers_of(wide[:, :2], [0, 1], layer_dim=1, num_hidden_layers=4)
    with pytest.raises(LayerMappingError, match="neither num_hidden_layers=7"):
        moe_layers_of(wide, MOE, layer_dim=1, num_hidden_layers=7)


def test_layer_axis_option_is_checked():
    assert ReplayConfig().layer_axis is None
    assert ReplayConfig(layer_axis="moe_only").layer_axis == "moe_only"
    with pytest.raises(ConfigError, match="r3bridge.layer_axis must be one of"):
        ReplayConfig(layer_axis="moe")


def test_trtllm_batch_round_trips_through_shard_and_unshard():
    """The existing replay path: rank targets for tp=2 x pp=2 of the dense-first model carry the
    TensorRT-LLM routes on the right global layers, and unshard gives the batch back."""
    rng = np.random.default_rng(3)
    arrays = [_moe_only(rng, 6, 5), _moe_only(rng, 4, 4)]
    rb = ReplayBatch.from_trtllm(arrays, num_experts=E, moe_layer_ids=MOE)
    layout = ParallelLayout(HIDDEN, FREQ, tp=2, pp=2)
    seq_lens = [11, 8]
    parts = {(t, 0, p, 0): shard(rb, layout, seq_lens, tp_rank=t, pp_rank=p) for t in range(2) for p in range(2)}
    assert sorted(parts[(0, 0, 0, 0)].indices) == [2] and sorted(parts[(0, 0, 1, 0)].indices) == [3, 4, 5]
    back = unshard(parts, layout, seq_lens, num_experts=E)
    for i, a in enumerate(arrays):
        routes, valid = back.sequence(i)
        assert bool(valid[: a.shape[0]].all())
        assert np.array_equal(routes[: a.shape[0]].sort(-1).values.numpy(), np.sort(a, -1))


def test_physical_replica_slots_are_refused_as_not_logical_ids():
    """Expert ids are logical (pre-EPLB): a slot of a redundant-expert placement (>= num_experts)
    is refused, and the message says which id space is expected."""
    a = _moe_only(np.random.default_rng(4), 3, 3)
    a[1, 2, 0] = E + 3                                  # an EPLB replica slot, not an expert id
    with pytest.raises(RouteValueError, match=r"layer 4: expert ids .* out of range \[0, 16\).*logical"):
        ReplayBatch.from_trtllm([a], num_experts=E, moe_layer_ids=MOE)
