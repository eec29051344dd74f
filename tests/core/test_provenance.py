"""Route provenance: validated on every batch, kept by every operation that slices, reorders or
concatenates sequences, carried by the wire format, and compared with the log-probs' provenance."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from r3bridge import PayloadError, ProvenanceError, ReplayBatch, RouteProvenance, stitch
from r3bridge.batch.canonical import canonical_form, drop_final_invalid_rows, with_empty_sequences, with_route_kind
from r3bridge.batch.provenance import check_pairing, sglang_provenance, vllm_provenance
from r3bridge.rollout.provenance import first_seen_provenance
from r3bridge.rollout.stitching import rollout_routes

from ._reference import random_routes

E, L, K = 16, 2, 2
P = [RouteProvenance("vllm", f"req-{i}", 7, i) for i in range(3)]


def batch(provenance=P, rows=(4, 3, 5), seed=0):
    rng = np.random.default_rng(seed)
    return ReplayBatch.from_ragged(
        [random_routes(rng, r, L, K, E) for r in rows], num_experts=E, layer_ids=[1, 3], provenance=provenance
    )


def test_route_provenance_fields_are_validated():
    assert RouteProvenance("sglang").weight_version is None and RouteProvenance("sglang").epoch is None
    assert RouteProvenance("vllm", "r", np.int64(3), 0).weight_version == 3
    for bad, frag in (
        (dict(engine=""), "engine"),
        (dict(engine="v", request_id=3), "request_id"),
        (dict(engine="v", weight_version=-1), "weight_version"),
        (dict(engine="v", weight_version=True), "weight_version"),
        (dict(engine="v", epoch=1.5), "epoch"),
        (dict(engine="v", epoch=2**31), "epoch"),
    ):
        with pytest.raises(ProvenanceError, match=frag):
            RouteProvenance(**bad)


def test_batch_provenance_is_validated_naming_the_sequence():
    with pytest.raises(ProvenanceError, match="2 entries for 3 sequences"):
        batch(P[:2])
    with pytest.raises(ProvenanceError, match="sequence 1: provenance must be a RouteProvenance"):
        batch([P[0], {"engine": "vllm"}, P[2]])
    with pytest.raises(ProvenanceError, match="one per sequence"):
        batch(P[0])
    assert batch(None).provenance is None
    assert batch([P[0], None, P[2]]).provenance == (P[0], None, P[2])


def test_every_sequence_operation_keeps_provenance():
    rb = batch()
    assert rb.provenance == tuple(P)
    assert rb.select([2, 0]).provenance == (P[2], P[0])
    assert rb.select_range(1, 3).provenance == (P[1], P[2])
    assert rb.with_layers([3]).provenance == tuple(P)
    assert rb.to("cpu").provenance == tuple(P)
    assert with_route_kind(rb, "rollout", None).provenance == tuple(P)
    # a batch without provenance contributes unknown entries, not a dropped field
    assert ReplayBatch.concat([rb, batch(None, rows=(2,))]).provenance == (*P, None)
    assert ReplayBatch.concat([batch(None), batch(None)]).provenance is None
    padded = with_empty_sequences(rb, [6, 6])
    assert padded.provenance == (*P, None, None)
    full = canonical_form(rb, [5, 4, 6])
    assert full.provenance == tuple(P) and full.rows_per_seq == [4, 3, 5]  # final rows without a route dropped
    assert drop_final_invalid_rows(full).provenance == tuple(P)


def test_from_vllm_and_from_sglang_take_provenance():
    rng = np.random.default_rng(1)
    arrays = [random_routes(rng, 5, 3, K, E).astype(np.uint8) for _ in range(2)]
    rb = ReplayBatch.from_vllm(arrays, num_experts=E, moe_layer_ids=[1, 2], provenance=P[:2])
    assert rb.provenance == tuple(P[:2])
    as_lists = ReplayBatch.from_vllm([a.tolist() for a in arrays], num_experts=E, provenance=P[:2])
    assert as_lists.provenance == tuple(P[:2])
    meta = [
        {
            "routed_experts": base64.b64encode(a.astype("<i4").tobytes()).decode(),
            "prompt_tokens": 3,
            "completion_tokens": 3,
        }
        for a in arrays
    ]
    with pytest.raises(ProvenanceError, match="1 entries for 2 sequences"):
        ReplayBatch.from_sglang(meta, num_experts=E, num_layers=3, topk=K, provenance=P[:1])
    assert ReplayBatch.from_sglang(meta, num_experts=E, num_layers=3, topk=K, provenance=P[1:3]).provenance == tuple(
        P[1:3]
    )


def test_engine_provenance_helpers_read_what_the_engines_report():
    meta = {"id": "rid-9", "weight_version": "12", "num_retractions": 1}
    assert sglang_provenance(meta) == RouteProvenance("sglang", "rid-9", 12, 1)
    # SGLang's tag before any named weight update is not a number: unknown, or the framework's own
    assert sglang_provenance({"id": "r", "weight_version": "default"}).weight_version is None
    assert sglang_provenance({"id": "r", "weight_version": "default"}, weight_version=4).weight_version == 4
    out = SimpleNamespace(request_id="cmpl-1", outputs=[SimpleNamespace(num_preempted=2)])
    assert vllm_provenance(out, weight_version=5) == RouteProvenance("vllm", "cmpl-1", 5, 2)
    assert vllm_provenance(SimpleNamespace(request_id="x", outputs=[])).epoch is None
    # an output type without a request id (a framework's own): the framework names the request
    assert vllm_provenance(SimpleNamespace(num_preempted=1), request_id="s7") == RouteProvenance("vllm", "s7", None, 1)


def test_first_seen_provenance_is_one_rule_for_every_engine_reader():
    """The one builder: the routes are the first call's pass (its attempt), the log-probs the same
    request's first pass (epoch 0 where the engine reports epochs) under the sampled version and
    the last call's attempt; fed by either engine reader."""
    out = SimpleNamespace(request_id="cmpl-1", outputs=[SimpleNamespace(num_preempted=2)])
    routes, logprobs = first_seen_provenance(vllm_provenance(out, weight_version=5), sampled_version=4, calls=3,
                                             attempts=[0, 0, 1])
    assert routes == RouteProvenance("vllm", "cmpl-1", 5, 2, 0)
    assert logprobs == RouteProvenance("vllm", "cmpl-1", 4, 0, 1)
    assert routes.differences(logprobs) == ("weight_version", "epoch", "attempt")
    routes, logprobs = first_seen_provenance(sglang_provenance({"id": "r1", "weight_version": "7"}),
                                             sampled_version=None)
    assert (routes.weight_version, routes.epoch, routes.attempt) == (7, None, None)
    assert (logprobs.request_id, logprobs.weight_version, logprobs.epoch, logprobs.attempt) == ("r1", None, None, None)
    with pytest.raises(ProvenanceError, match="sample r1: no server call"):
        first_seen_provenance(RouteProvenance("sglang", "r1"), sampled_version=None, calls=0)
    with pytest.raises(ProvenanceError, match=r"sample \?: 1 attempts for 2 server calls"):
        first_seen_provenance(RouteProvenance("vllm"), sampled_version=None, calls=2, attempts=[0])


def test_stitch_keeps_the_first_pass_provenance():
    rng = np.random.default_rng(2)
    first, resubmit = random_routes(rng, 6, L, K, E), random_routes(rng, 9, L, K, E)
    p0, p1 = RouteProvenance("sglang", "r", 3, 0), RouteProvenance("sglang", "r", 4, 1)
    a = ReplayBatch.from_ragged([first, first[:0]], num_experts=E, layer_ids=[1, 3], provenance=[p0, None])
    b = ReplayBatch.from_ragged([resubmit, resubmit], num_experts=E, layer_ids=[1, 3], provenance=[p1, p1])
    out, _ = stitch([a, b])
    # sequence 0's earliest rows came from the first pass; sequence 1's only from the resubmit
    assert out.provenance == (p0, p1)
    calls = [[first.astype(np.uint8), resubmit.astype(np.uint8)]]
    rb = rollout_routes(calls, num_experts=E, moe_layer_ids=[0, 1], provenance=[p0])
    assert rb.provenance == (p0,) and rb.route_kind == "rollout"


@pytest.mark.parametrize("provenance", [P, [None, P[1], None], None])
def test_wire_roundtrip_keeps_provenance(provenance):
    rb = batch(provenance)
    data = rb.to_bytes()
    assert len(data) == rb.nbytes
    back = ReplayBatch.from_bytes(data)
    assert back.equals(rb) and back.provenance == rb.provenance
    assert data[7] & 2 == (2 if provenance is not None else 0)  # flags bit1


def test_wire_keeps_unicode_and_absent_fields():
    odd = [
        RouteProvenance("sglang", "", None, None),
        RouteProvenance("vllm", "req-ü-😀", 2**40, 2**31 - 1),
        RouteProvenance("areal/sglang", "r" * 300, 0, 0),
    ]
    back = ReplayBatch.from_bytes(batch(odd).to_bytes())
    assert back.provenance == tuple(odd)


def test_wire_refuses_unknown_flags():
    import struct
    import zlib

    data = bytearray(batch().to_bytes())
    data[7] |= 8  # a flag this version does not know (bit0 policy versions, bit1 provenance, bit2 weights)
    struct.pack_into("<I", data, 34, zlib.crc32(bytes(data[:34])))
    with pytest.raises(PayloadError, match="unknown flags"):
        ReplayBatch.from_bytes(bytes(data))


def test_check_pairing_counts_refuses_and_passes():
    routes = [
        RouteProvenance("sglang", "a", 3, 0),
        RouteProvenance("sglang", "b", 4, 1),
        RouteProvenance("sglang", "c", 3, 0),
        None,
    ]
    logp = [
        RouteProvenance("sglang", "a", 3, 0),
        RouteProvenance("sglang", "b", 3, 0),
        RouteProvenance("sglang", "c"),
        RouteProvenance("sglang", "d", 3, 0),
    ]
    c = check_pairing(routes, logp, "count")
    # sample 2: only the request id is known on both (equal); sample 3: no route provenance
    assert (c.checked, c.mismatched, c.unchecked) == (3, 1, 1)
    assert c.as_metrics("r3bridge/update/") == {
        "r3bridge/update/provenance/checked_samples": 3.0,
        "r3bridge/update/provenance/mismatched_samples": 1.0,
        "r3bridge/update/provenance/unchecked_samples": 1.0,
    }
    with pytest.raises(
        ProvenanceError,
        match=r"uid-b: .*weight_version, epoch differ.*weight_version=4 epoch=1"
        r".*weight_version=3 epoch=0",
    ):
        check_pairing(routes, logp, "refuse", names=["uid-a", "uid-b", "uid-c", "uid-d"])
    assert check_pairing(routes[:1], logp[:1], "refuse").mismatched == 0
    assert check_pairing(routes, logp, "off").checked == 0
    # different engines differ outright, even with nothing else known
    assert check_pairing([RouteProvenance("vllm")], [RouteProvenance("sglang")], "count").mismatched == 1
    assert check_pairing([RouteProvenance("vllm")], [RouteProvenance("vllm")], "count").unchecked == 1
    with pytest.raises(ProvenanceError, match="provenance_check must be"):
        check_pairing(routes, logp, "warn")
    with pytest.raises(ProvenanceError, match="log-prob provenance for 1 samples, the pass has 4"):
        check_pairing(routes, logp[:1], "count")


def test_every_sample_is_counted_also_when_no_side_is_known():
    """checked + unchecked = the pass's samples, also for a batch without any provenance field
    (verl's stock agent loops, SkyRL: both sides None): 8 unchecked, not 0 (issue 39)."""
    from r3bridge.batch.provenance import ProvenancePairing

    for pairing in (ProvenancePairing(None, None, None, 8), ProvenancePairing(None, None, [f"s{i}" for i in range(8)])):
        c = pairing.check("count")
        assert (c.checked, c.mismatched, c.unchecked) == (0, 0, 8)
        assert pairing.select([1, 5, 6]).check("count").unchecked == 3
    half = ProvenancePairing([RouteProvenance("hf", "a", 1, 0)] * 2, None, samples=2)
    assert half.check("count").unchecked == 2
    with pytest.raises(ProvenanceError, match="route provenance for 2 samples, the pass has 3"):
        ProvenancePairing([RouteProvenance("hf", "a", 1, 0)] * 2, None, samples=3).check("count")


def test_recorded_and_trusted_batches_have_no_provenance():
    rb = ReplayBatch.from_trusted(
        torch.zeros((2, 1, 1), dtype=torch.uint8), [2], [0], torch.ones(2, dtype=torch.bool), (0,), 4, "recorded"
    )
    assert rb.provenance is None


def test_versions_tensor_roundtrip_and_errors():
    from r3bridge.batch.provenance import ProvenancePairing, from_versions_tensor, versions_tensor

    items = [RouteProvenance("sglang", "", 3, 1, 2), None, RouteProvenance("sglang", "", None, 0)]
    t = versions_tensor(items)
    assert t.tolist() == [[3, 1, 2], [-1, -1, -1], [-1, 0, -1]] and t.dtype == torch.int64
    assert from_versions_tensor(t, engine="sglang", what="f") == items
    # fields written before attempts ([samples, 2]) still read, attempt unknown
    assert from_versions_tensor(t[:, :2], engine="sglang", what="f")[0] == RouteProvenance("sglang", "", 3, 1)
    with pytest.raises(ProvenanceError, match=r"field x must be an integer \[samples, 3\]"):
        from_versions_tensor(torch.zeros(3, 3), engine="sglang", what="field x")
    with pytest.raises(ProvenanceError, match="field x, sample 1: .*weight_version"):
        from_versions_tensor(torch.tensor([[1, 0], [-5, 0]]), engine="sglang", what="field x")
    pairing = ProvenancePairing(items, [None, None, items[2]], ["a", "b", "c"])
    sub = pairing.select([2, 0])
    assert sub.routes == [items[2], items[0]] and sub.logprobs == [items[2], None] and sub.names == ["c", "a"]


def test_a_retry_never_stands_in_for_another_attempt():
    """NeMo RL #4057: attempts of one sample are told apart. Routes of attempt 1 paired with log-probs
    of attempt 0 differ in ``attempt``: counted or refused per provenance_check; stitching refuses
    to let a retry's rows fill or follow another attempt's; the attempt survives the wire."""
    from r3bridge.batch.provenance import check_pairing
    from r3bridge.errors import StitchError
    from r3bridge.rollout.stitching import stitch

    first, retry = RouteProvenance("vllm", "r1", 4, 0, 0), RouteProvenance("vllm", "r1", 4, 0, 1)
    assert retry.differences(first) == ("attempt",) and "attempt=1" in str(retry)
    assert RouteProvenance("vllm", "r1", 4, 0).differences(retry) == ()        # unknown: not compared
    count = check_pairing([retry, first], [first, first], "count", names=["s0", "s1"])
    assert (count.checked, count.mismatched) == (2, 1)
    with pytest.raises(ProvenanceError, match=r"s0: its routes came from another engine pass .*\(attempt differ\).*"
                                              r"attempt=1.*attempt=0"):
        check_pairing([retry, first], [first, first], "refuse", names=["s0", "s1"])

    def piece(rows, prov, start=0):
        return ReplayBatch.from_ragged([torch.tensor([[[0, 1]]] * rows)], num_experts=4, layer_ids=[1],
                                       start_rows=[start], provenance=[prov])
    same, _ = stitch([piece(3, first), piece(5, RouteProvenance("vllm", "r1", 4, 1, 0))])   # a re-prefill: one attempt
    assert same.rows_per_seq == [5] and same.provenance == (first,)
    with pytest.raises(StitchError, match=r"sequence 0, piece 1: routes of attempt 1 .* rows of attempt 0"):
        stitch([piece(3, first), piece(5, retry)])
    rb = piece(2, retry)
    assert ReplayBatch.from_bytes(rb.to_bytes()).provenance == (retry,)
