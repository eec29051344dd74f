"""Wire format: to_bytes / from_bytes round trip, nbytes == len(to_bytes()), corrupted payloads."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3bridge import PayloadError, ReplayBatch, ReplayError
from r3bridge.batch.provenance import RouteProvenance

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
    kind, engine = draw(st.sampled_from([("rollout", "vllm"), ("rollout", "sglang"), ("recorded", None),
                                         ("rollout", "ünïcode")]))
    return ReplayBatch.from_ragged(arrays, num_experts=E, layer_ids=layer_ids, start_rows=starts,
                                   valid=valid, route_kind=kind, engine=engine, policy_versions=pv)


@settings(max_examples=60, deadline=None)
@given(replay_batches())
def test_roundtrip_and_nbytes(rb):
    data = rb.to_bytes()
    assert isinstance(data, bytes)
    assert rb.nbytes == len(data)
    back = ReplayBatch.from_bytes(data)
    assert back.equals(rb)
    assert (back.route_kind, back.engine) == (rb.route_kind, rb.engine) and back.policy_versions == rb.policy_versions
    assert back.routes.dtype == rb.routes.dtype
    assert ReplayBatch.from_bytes(memoryview(bytearray(data))).equals(rb)


def test_payload_size_is_routes_plus_small_header():
    """uint8 routes: about one byte per (row, layer, k) plus a header and 1 bit per row."""
    rng = np.random.default_rng(0)
    rows, L, K = [100, 37], 5, 8
    rb = ReplayBatch.from_ragged([random_routes(rng, r, L, K, 64) for r in rows], num_experts=64,
                                 layer_ids=list(range(L)), engine="x")
    routes_bytes = sum(rows) * L * K
    assert routes_bytes < rb.nbytes < routes_bytes + 120
    rb16 = ReplayBatch.from_ragged([random_routes(rng, r, L, K, 300) for r in rows], num_experts=300,
                                   layer_ids=list(range(L)), engine="x")
    assert rb16.nbytes - rb.nbytes == routes_bytes      # int16: exactly one extra byte per id


def _sample():
    rng = np.random.default_rng(1)
    return ReplayBatch.from_ragged([random_routes(rng, 4, 2, 2, 8), random_routes(rng, 3, 2, 2, 8)],
                                   num_experts=8, layer_ids=[1, 3], engine="vllm")


@pytest.mark.parametrize("cut", [0, 5, 30, -1, -7])
def test_truncated_payload_raises(cut):
    data = _sample().to_bytes()
    with pytest.raises(PayloadError, match="truncated"):
        ReplayBatch.from_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])


def test_trailing_garbage_raises():
    with pytest.raises(PayloadError, match="truncated or extended"):
        ReplayBatch.from_bytes(_sample().to_bytes() + b"\0")


_FIELDS = struct.Struct("<4sHBBIQIIIH")     # header fields before the header checksum


def _reseal(data: bytearray) -> bytes:
    """Recompute both checksums, as a writer with a bug (not a damaged wire) would: what is
    left to refuse is re-validation's job."""
    struct.pack_into("<I", data, _FIELDS.size, zlib.crc32(bytes(data[:_FIELDS.size])))
    body = bytes(data[_FIELDS.size + 4:-4])
    struct.pack_into("<I", data, len(data) - 4, zlib.crc32(body))
    return bytes(data)


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
        ReplayBatch.from_bytes(_reseal(bad))
    bad = bytearray(data)
    bad[_FIELDS.size + 4] = 0xFF                          # first byte of the source string
    with pytest.raises(PayloadError, match="UTF-8"):
        ReplayBatch.from_bytes(_reseal(bad))


def test_payload_is_revalidated():
    """A well-sealed payload whose routes are invalid is refused like any input."""
    rb = _sample()
    data = bytearray(rb.to_bytes())
    data[-5] = data[-6]                                   # last row, last layer: duplicate ids
    with pytest.raises(ReplayError, match="sequence 1, row 2"):
        ReplayBatch.from_bytes(_reseal(data))
    data = bytearray(rb.to_bytes())
    data[-5] = 200                                        # >= num_experts
    with pytest.raises(ReplayError, match="out of range"):
        ReplayBatch.from_bytes(_reseal(data))


def _realistic() -> bytes:
    """Three vLLM-like sequences (prompt offsets, a few rows without a route, policy versions,
    provenance: one sequence without), 64 experts top-4 on 3 MoE layers of a dense-first model:
    every header field and every body section is present and non-trivial."""
    rng = np.random.default_rng(7)
    rows = [9, 14, 5]
    valid = [rng.random(r) > 0.2 for r in rows]
    rb = ReplayBatch.from_ragged([random_routes(rng, r, 3, 4, 64) for r in rows], num_experts=64,
                                 layer_ids=[1, 2, 5], start_rows=[0, 3, 11], valid=valid,
                                 engine="vllm", policy_versions=[4, 4, 3],
                                 provenance=[RouteProvenance("vllm", "req-0", 4, 0), None,
                                             RouteProvenance("sglang", "r2", None, 1)])
    return rb.to_bytes()


def test_every_single_byte_flip_is_refused():
    """Before checksums, 267 of 962 such flips of a 3-sequence payload decoded into a different
    batch (other num_experts, layer ids, start rows, expert ids, or all rows invalid)."""
    data = _realistic()
    ReplayBatch.from_bytes(data)
    accepted, checks = [], {}
    for i in range(len(data)):
        for mask in (0x01, 0xFF):
            bad = bytearray(data)
            bad[i] ^= mask
            try:
                ReplayBatch.from_bytes(bytes(bad))
            except PayloadError as e:
                checks[str(e).split(":")[0][:60]] = checks.get(str(e).split(":")[0][:60], 0) + 1
            else:
                accepted.append((i, mask))
    assert not accepted, f"{len(accepted)} damaged payloads decoded, first at (byte, xor) {accepted[:5]}"
    # each region is caught by its own check, and the message says which
    text = " | ".join(checks)
    for check in ("magic", "version", "header checksum", "body checksum"):
        assert check in text, (check, checks)


def test_every_truncation_is_refused():
    data = _realistic()
    for cut in range(len(data)):
        with pytest.raises(PayloadError, match="truncated"):
            ReplayBatch.from_bytes(data[:cut])


def test_version_1_payload_is_refused_with_a_hint():
    """A payload of the format before checksums (version 1) is refused, not misread."""
    rb = _sample()
    v1 = bytearray(rb.to_bytes())
    struct.pack_into("<H", v1, 4, 1)
    with pytest.raises(PayloadError, match="version 1 .*re-encode.*reads versions 2, 3"):
        ReplayBatch.from_bytes(bytes(v1))
