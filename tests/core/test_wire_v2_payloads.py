"""Older wire-format payloads still decode, field for field: version 2 (written by r3bridge at
96e9d2f, before provenance) and version 3 (at 6ceaa8d, provenance without attempts). A stored route
file or a payload in flight from an older worker must stay readable after a version bump."""

from __future__ import annotations

import torch

from r3bridge import ReplayBatch

# ReplayBatch.from_ragged([[[0,1],[2,3]], [[4,5],[6,7]] (invalid), [[1,0],[3,2]]] and [[[7,6],[5,4]]],
# num_experts=8, layer_ids=[1, 3], start_rows=[0, 2], engine="vllm", policy_versions=[5, 6]).to_bytes()
V2_VLLM = bytes.fromhex(
    "523352420200010102000000040000000000000002000000020000000800000004000998b920766c6c6d01000000"
    "030000000300000000000000010000000000000000000000000000000200000000000000050000000000000006000000"
    "000000000d0001020300010001010003020706050456826fb8"
)
# ReplayBatch.from_packed(zeros((0, 1, 1)), [], num_experts=300, layer_ids=[0]).to_bytes(): int16, no policy versions
V2_EMPTY = bytes.fromhex(
    "523352420200020000000000000000000000000001000000010000002c0100000600cace3d0172616767656400000000993c9afa"
)


def test_v2_payload_decodes_field_for_field():
    rb = ReplayBatch.from_bytes(V2_VLLM)
    assert rb.rows_per_seq == [3, 1] and rb.start_rows == [0, 2]
    assert rb.layer_ids == (1, 3) and rb.num_experts == 8 and rb.topk == 2
    assert rb.engine == "vllm" and rb.policy_versions == [5, 6]
    assert rb.routes.dtype == torch.uint8
    assert rb.routes.tolist() == [[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[1, 0], [3, 2]], [[7, 6], [5, 4]]]
    assert rb.valid.tolist() == [True, False, True, True]


def test_v2_empty_int16_payload_decodes():
    rb = ReplayBatch.from_bytes(V2_EMPTY)
    assert rb.num_seqs == 0 and rb.total_rows == 0 and rb.routes.dtype == torch.int16
    assert rb.num_experts == 300 and rb.layer_ids == (0,) and rb.engine == "ragged" and rb.policy_versions is None


# ReplayBatch.from_ragged([[[[0,1],[2,3]],[[4,5],[6,7]]], [[[7,6],[5,4]]]], num_experts=8, layer_ids=[1, 3],
# valid=[[True, False], [True]], engine="vllm", provenance=[RouteProvenance("vllm", "req-7", 5, 1), None]).to_bytes()
V3_PROVENANCE = bytes.fromhex(
    "52335242030001020200000003000000000000000200000002000000080000000400826894ca766c6c6d010000000300000002000000"
    "000000000100000000000000000000000000000000000000000000000500000000000000ffffffffffffffff01000000ffffffff0400"
    "00000500000000000000766c6c6d7265712d3705000102030001000107060504352a3c7c"
)


def test_v3_payload_decodes_with_attempts_unknown():
    from r3bridge.batch.provenance import RouteProvenance
    from r3bridge.batch.wire import VERSION

    rb = ReplayBatch.from_bytes(V3_PROVENANCE)
    assert rb.rows_per_seq == [2, 1] and rb.layer_ids == (1, 3) and rb.engine == "vllm"
    assert rb.valid.tolist() == [True, False, True]
    assert rb.provenance == (RouteProvenance("vllm", "req-7", 5, 1), None) and rb.provenance[0].attempt is None
    assert rb.routes.tolist() == [[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[7, 6], [5, 4]]]
    assert VERSION == 4 and ReplayBatch.from_bytes(rb.to_bytes()).provenance == rb.provenance
