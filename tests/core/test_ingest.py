"""Engine formats: vLLM ``CompletionOutput.routed_experts`` and SGLang ``meta_info`` payloads."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from r3bridge import (
    CoverageError,
    LayerMappingError,
    ParallelLayout,
    PayloadError,
    ReplayBatch,
    RouteShapeError,
    RouteValueError,
    shard,
)

from ._reference import random_routes


class CompletionOutput:
    """vLLM can't run here: a stand-in with exactly vLLM's ``routed_experts`` format — numpy
    ``[prompt + generated - 1, num_hidden_layers, topk]``, uint8 (uint16 above 256 experts),
    read-only — and None for aborted requests."""

    def __init__(self, routed_experts):
        self.routed_experts = routed_experts


def vllm_array(rng, prompt, generated, num_hidden_layers, topk, num_experts, dense=(), start=0):
    rows = prompt + generated - 1 - start
    a = random_routes(rng, rows, num_hidden_layers, topk, num_experts)
    a[:, list(dense)] = 0                                   # engines report dense layers as zeros
    a = a.astype(np.uint8 if num_experts <= 256 else np.uint16)
    a.flags.writeable = False
    return a


def sglang_meta(routes_int32: np.ndarray, prompt: int, completion: int):
    """Exactly SGLang's form: base64 of the flat int32 buffer (token, layer, k)."""
    return {"routed_experts": base64.b64encode(np.ascontiguousarray(routes_int32, dtype=np.int32).tobytes()),
            "prompt_tokens": prompt, "completion_tokens": completion}


# ------------------------------------------------------------------------------ vLLM
def test_from_vllm_completion_outputs_all_layers_reported():
    rng = np.random.default_rng(0)
    lens = [(5, 3), (2, 1), (7, 9)]
    arrays = [vllm_array(rng, p, g, 4, 2, 16) for p, g in lens]
    rb = ReplayBatch.from_vllm([CompletionOutput(a) for a in arrays], num_experts=16)
    assert rb.rows_per_seq == [p + g - 1 for p, g in lens] and rb.layer_ids == (0, 1, 2, 3)
    assert rb.engine == "vllm" and rb.routes.dtype == torch.uint8
    for i, a in enumerate(arrays):
        assert np.array_equal(rb.sequence(i)[0].numpy(), a)
    rb.check_seq_lens([p + g for p, g in lens])            # the last sampled token has no row


def test_from_vllm_read_only_arrays_are_accepted_and_not_aliased():
    rng = np.random.default_rng(1)
    a = vllm_array(rng, 4, 4, 2, 2, 8)
    assert not a.flags.writeable
    rb = ReplayBatch.from_vllm([a], num_experts=8)
    rb.routes[0, 0, 0] = 7 - int(rb.routes[0, 0, 0])       # our buffer is writable ...
    assert int(a[0, 0, 0]) != int(rb.routes[0, 0, 0])      # ... and not vLLM's
    # the same holds with dense columns dropped (a fancy-indexed copy)
    rb2 = ReplayBatch.from_vllm([CompletionOutput(a)], num_experts=8, moe_layer_ids=[1])
    assert np.array_equal(rb2.routes.numpy()[:, 0], a[:, 1])


def test_from_vllm_moe_layer_ids_select_the_right_columns():
    """Dense-first model: vLLM reports 6 layers, 0 and 1 dense (zero rows)."""
    rng = np.random.default_rng(2)
    a = vllm_array(rng, 6, 4, 6, 2, 32, dense=(0, 1))
    rb = ReplayBatch.from_vllm([CompletionOutput(a)], num_experts=32, moe_layer_ids=[2, 3, 4, 5])
    assert rb.layer_ids == (2, 3, 4, 5)
    assert np.array_equal(rb.routes.numpy(), a[:, 2:])
    with pytest.raises(RouteValueError, match="layer 0"):   # the zero rows are not routes
        ReplayBatch.from_vllm([a], num_experts=32)
    with pytest.raises(LayerMappingError, match="out of range for 6 reported layers"):
        ReplayBatch.from_vllm([a], num_experts=32, moe_layer_ids=[2, 6])


def test_from_vllm_uint16_above_256_experts():
    rng = np.random.default_rng(3)
    a = vllm_array(rng, 5, 5, 3, 8, 384)
    assert a.dtype == np.uint16 and int(a.max()) > 255
    rb = ReplayBatch.from_vllm([CompletionOutput(a)], num_experts=384)
    assert rb.routes.dtype == torch.int16
    assert np.array_equal(rb.routes.numpy().astype(np.int64), a.astype(np.int64))
    old = a.astype(np.int32)                                  # older builds: int32
    assert ReplayBatch.from_vllm([old], num_experts=384).equals(rb)


def test_from_vllm_prompt_start_rows():
    rng = np.random.default_rng(4)
    prompt, gen, start = 10, 6, 4
    a = vllm_array(rng, prompt, gen, 2, 2, 8, start=start)
    rb = ReplayBatch.from_vllm([CompletionOutput(a)], num_experts=8, start_rows=[start])
    assert rb.start_rows == [start] and rb.rows_per_seq == [prompt + gen - 1 - start]
    t = shard(rb, ParallelLayout(2, 1), [prompt + gen])
    assert t.valid.tolist() == [False] * start + [True] * (prompt + gen - 1 - start) + [False]
    assert np.array_equal(t.indices[1][start:-1].numpy(), a[:, 1].astype(np.int64))


def test_from_vllm_aborted_request_raises():
    with pytest.raises(PayloadError, match="sequence 1"):
        ReplayBatch.from_vllm([np.zeros((1, 1, 1), np.uint8), CompletionOutput(None)], num_experts=4)


def test_from_vllm_wrong_rank_raises():
    with pytest.raises(RouteShapeError, match="sequence 0"):
        ReplayBatch.from_vllm([np.zeros((3, 2), np.uint8)], num_experts=4)


# ------------------------------------------------------------------------------ SGLang
@pytest.mark.parametrize("as_str", [False, True])
def test_from_sglang_base64_int32(as_str):
    rng = np.random.default_rng(5)
    L, K, E = 4, 2, 64
    lens = [(5, 3), (3, 1)]
    full = [random_routes(rng, p + c - 1, L, K, E) for p, c in lens]
    for a in full:
        a[:, 0] = 0                                           # layer 0 dense: zero rows
    metas = [sglang_meta(a, p, c) for a, (p, c) in zip(full, lens)]
    if as_str:
        for m in metas:
            m["routed_experts"] = m["routed_experts"].decode()
    rb = ReplayBatch.from_sglang(metas, num_experts=E, num_layers=L, topk=K, moe_layer_ids=[1, 2, 3])
    assert rb.engine == "sglang" and rb.layer_ids == (1, 2, 3) and rb.rows_per_seq == [7, 3]
    for i, a in enumerate(full):
        assert np.array_equal(rb.sequence(i)[0].numpy(), a[:, 1:])


def test_from_sglang_start_rows():
    rng = np.random.default_rng(6)
    p, c, s = 8, 4, 5
    a = random_routes(rng, p + c - 1 - s, 2, 2, 8)
    rb = ReplayBatch.from_sglang([sglang_meta(a, p, c)], num_experts=8, num_layers=2, topk=2, start_rows=[s])
    assert rb.start_rows == [s] and rb.rows_per_seq == [p + c - 1 - s]
    with pytest.raises(PayloadError, match="expected 11"):   # without the start row it does not fit
        ReplayBatch.from_sglang([sglang_meta(a, p, c)], num_experts=8, num_layers=2, topk=2)


def _good(rows=3, L=2, K=2):
    a = np.tile(np.arange(K, dtype=np.int32), (rows, L, 1))
    return sglang_meta(a, 2, rows - 1)


@pytest.mark.parametrize("payload, exc, frag", [
    ("not base64!!", PayloadError, "not valid base64"),
    (base64.b64encode(b"\x01\x00\x00\x00\x02\x00"), PayloadError, "not a whole number of int32"),
    (base64.b64encode(np.zeros(5, np.int32).tobytes()), PayloadError, "not divisible by num_layers*topk"),
    (base64.b64encode(np.tile(np.arange(2, dtype=np.int32), 8).tobytes()), PayloadError, "has 4 rows, expected 3"),
    ({}, PayloadError, "dict"),
    (None, PayloadError, "no routed_experts"),
])
def test_malformed_sglang_payloads(payload, exc, frag):
    metas = [_good(), dict(_good(), routed_experts=payload)]
    with pytest.raises(exc, match=None) as ei:
        ReplayBatch.from_sglang(metas, num_experts=4, num_layers=2, topk=2)
    assert "sequence 1" in str(ei.value) and frag in str(ei.value)


def test_malformed_sglang_meta_info():
    good = _good()
    with pytest.raises(PayloadError, match="sequence 1: meta_info lacks 'completion_tokens'"):
        ReplayBatch.from_sglang([good, {"routed_experts": good["routed_experts"], "prompt_tokens": 2}],
                                num_experts=4, num_layers=2, topk=2)
    with pytest.raises(PayloadError, match="sequence 0: meta_info must be a dict"):
        ReplayBatch.from_sglang([None], num_experts=4, num_layers=2, topk=2)
    with pytest.raises(PayloadError, match="sequence 0"):
        ReplayBatch.from_sglang([dict(good, prompt_tokens="x")], num_experts=4, num_layers=2, topk=2)
    with pytest.raises(RouteShapeError, match="must be >= 1"):
        ReplayBatch.from_sglang([good], num_experts=4, num_layers=0, topk=2)
    with pytest.raises(CoverageError, match="start_rows has 2"):
        ReplayBatch.from_sglang([good], num_experts=4, num_layers=2, topk=2, start_rows=[0, 0])


def test_sglang_ids_are_validated_after_dense_columns_are_dropped():
    a = np.tile(np.arange(2, dtype=np.int32), (3, 2, 1))
    a[1, 1] = [9, 1]                                          # layer 1 (MoE), row 1: id 9 >= 4
    with pytest.raises(RouteValueError, match="sequence 0, row 1 .token 1., layer 1"):
        ReplayBatch.from_sglang([sglang_meta(a, 2, 2)], num_experts=4, num_layers=2, topk=2)
