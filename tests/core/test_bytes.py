"""Wire format: to_bytes / from_bytes round trip, nbytes == len(to_bytes()), corrupted payloads."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3bridge import PayloadError, ReplayBatch, ReplayError

from ._reference import random_routes


@st.composite
def replay_batches(draw):
    E, K = draw(st.sampled_from([(2, 1), (8, 2), (256, 8), (257, 3), (5000, 4), (40000, 2)]))
    L = draw(st.integers(0, 4))
    rows = draw(st.lists(st.integers(0, 9), max_size=5))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    arrays = [random_routes(rng, r, L, K, E) for r in rows]
    valid = [rng.random(r) > 0.3 for r in rows]
    layer_ids = sorted(rng.choice(64, L, replace=False).tolist())
    starts = [int(x) for x in rng.integers(0, 100, len(rows))]
    pv = draw(st.none() | st.just([int(x) for x in rng.integers(0, 9, len(rows))]))
    src = draw(st.sampled_from(["vllm", "sglang", "recorded", "ünïcode"]))
    return ReplayBatch.from_ragged(arrays, num_experts=E, layer_ids=layer_ids, start_rows=starts,
                                   valid=valid, source=src, policy_versions=pv)


@settings(max_examples=60, deadline=None)
@given(replay_batches())
def test_roundtrip_and_nbytes(rb):
    data = rb.to_bytes()
    assert isinstance(data, bytes)
    assert rb.nbytes == len(data)
    back = ReplayBatch.from_bytes(data)
    assert back.equals(rb)
    assert back.source == rb.source and back.policy_versions == rb.policy_versions
    assert back.routes.dtype == rb.routes.dtype
    assert ReplayBatch.from_bytes(memoryview(bytearray(data))).equals(rb)


def test_payload_size_is_routes_plus_small_header():
    """uint8 routes: about one byte per (row, layer, k) plus a header and 1 bit per row."""
    rng = np.random.default_rng(0)
    rows, L, K = [100, 37], 5, 8
    rb = ReplayBatch.from_ragged([random_routes(rng, r, L, K, 64) for r in rows], num_experts=64,
                                 layer_ids=list(range(L)), source="x")
    routes_bytes = sum(rows) * L * K
    assert routes_bytes < rb.nbytes < routes_bytes + 120
    rb16 = ReplayBatch.from_ragged([random_routes(rng, r, L, K, 300) for r in rows], num_experts=300,
                                   layer_ids=list(range(L)), source="x")
    assert rb16.nbytes - rb.nbytes == routes_bytes      # int16: exactly one extra byte per id


def _sample():
    rng = np.random.default_rng(1)
    return ReplayBatch.from_ragged([random_routes(rng, 4, 2, 2, 8), random_routes(rng, 3, 2, 2, 8)],
                                   num_experts=8, layer_ids=[1, 3], source="vllm")


@pytest.mark.parametrize("cut", [0, 5, 30, -1, -7])
def test_truncated_payload_raises(cut):
    data = _sample().to_bytes()
    with pytest.raises(PayloadError, match="truncated"):
        ReplayBatch.from_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])


def test_trailing_garbage_raises():
    with pytest.raises(PayloadError, match="truncated or corrupted"):
        ReplayBatch.from_bytes(_sample().to_bytes() + b"\0")


def test_bad_magic_version_dtype_and_source():
    data = bytearray(_sample().to_bytes())
    bad = bytearray(data)
    bad[:4] = b"XXXX"
    with pytest.raises(PayloadError, match="magic"):
        ReplayBatch.from_bytes(bytes(bad))
    bad = bytearray(data)
    struct.pack_into("<H", bad, 4, 99)
    with pytest.raises(PayloadError, match="version 99"):
        ReplayBatch.from_bytes(bytes(bad))
    bad = bytearray(data)
    bad[6] = 77
    with pytest.raises(PayloadError, match="dtype code 77"):
        ReplayBatch.from_bytes(bytes(bad))
    bad = bytearray(data)
    hdr = struct.calcsize("<4sHBBIQIIIH")
    bad[hdr] = 0xFF                                       # first byte of the source string
    with pytest.raises(PayloadError, match="UTF-8"):
        ReplayBatch.from_bytes(bytes(bad))


def test_payload_is_revalidated():
    """A payload whose route bytes were corrupted into an invalid route is refused like any input."""
    rb = _sample()
    data = bytearray(rb.to_bytes())
    data[-1] = data[-2]                                   # last row, last layer: duplicate ids
    with pytest.raises(ReplayError, match="sequence 1, row 2"):
        ReplayBatch.from_bytes(bytes(data))
    data = bytearray(rb.to_bytes())
    data[-1] = 200                                        # >= num_experts
    with pytest.raises(ReplayError, match="out of range"):
        ReplayBatch.from_bytes(bytes(data))
