"""The conformance suite itself: canonical rollouts exercise what it claims, and broken adapters fail."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from r3bridge import ParallelLayout, ReplayBatch
from r3bridge.batch.canonical import canonical_form, drop_final_invalid_rows
from r3bridge.protocols import BatchCodec
from r3bridge.session.phase import install_before_forward
from r3bridge.testing.kit.conformance import (
    assert_same_batch,
    check_ingest,
    check_recorded_survives_split,
    check_same_targets,
    make_rollout,
)


def test_rollouts_cover_the_hard_cases():
    r = make_rollout(0, batch_size=9)
    want = r.expected()
    assert want.route_kind == "rollout" and want.layer_ids == (1, 2, 3)
    assert any(len(c) > 1 for c in r.calls)                                  # multi-turn / resubmits
    assert any(r.call_prompt_lens[i][t + 1] == len(r.call_tokens[i][t])      # a resubmit
               for i in range(9) for t in range(len(r.calls[i]) - 1))
    assert not bool(want.valid.all())                                         # unrouted tails
    for i in range(9):                                                        # dense layer 0 is zero in the engine
        assert all(not c[:, 0].any() for c in r.calls[i])
        assert want.rows_per_seq[i] in (len(r.tokens[i]) - 1, len(r.tokens[i]))


def test_porting_md_documents_every_field_of_the_canonical_rollout_and_the_zero_row_rule():
    """A new framework's author reads porting.md, not the kit's source (issue 50 items 3 and 5): every
    field, property and method of CanonicalRollout has its row in the table, and porting.md and
    options.md state how an aborted sample is handed and counted."""
    import dataclasses
    from pathlib import Path

    from r3bridge.testing.kit.rollouts import CanonicalRollout

    docs = Path(__file__).resolve().parents[2] / "docs"
    porting = (docs / "porting.md").read_text()
    section = porting[porting.index("### The canonical rollout"):]
    table = section[:section.index("\n\n", section.index("| field |"))]
    public = {f.name for f in dataclasses.fields(CanonicalRollout)} | {
        name for name, value in vars(CanonicalRollout).items()
        if not name.startswith("_") and (isinstance(value, property) or callable(value))}
    missing = sorted(name for name in public if f"`{name}" not in table and f", `{name}`" not in table)
    assert not missing, f"porting.md's canonical rollout table lacks {missing}"
    rule = " ".join(porting.split())
    assert "an aborted sample** (the engine returned `routes=None`) still trains: hand it as **0 rows**" in rule
    assert "counted apart (`samples/without_routes`, outside `min_coverage` and `coverage_floor`)" in rule
    assert "Only 0 rows may start anywhere" in rule
    assert "a sample the engine returned no routes for is handed as 0" in " ".join((docs / "options.md").read_text().split())


def test_single_call_rollouts_have_one_engine_call_per_sample():
    r = make_rollout(0, batch_size=9, single_call=True, aborted=(4,))
    assert [len(c) for c in r.calls] == [1] * 9 and r.aborted == [4]
    assert all(r.call_prompt_lens[i] == [r.prompt_lens[i]] for i in range(9))
    want = r.expected()
    assert not bool(want.valid.all())                                         # unrouted tails stay
    for i in range(9):
        if i != 4:                                                            # the call's rows, first-seen
            rows = torch.as_tensor(r.calls[i][0][:, want.layer_ids].astype(np.int64))
            assert torch.equal(want.sequence(i)[0][:len(rows)].long(), rows)


class _Dict:
    """A minimal BatchCodec over {"routes": ReplayBatch, "lens": [...]} (what a correct adapter does)."""

    def __init__(self, lose_order=False, last_seen=False):
        self.lose_order, self.last_seen = lose_order, last_seen

    def to_replay_batch(self, native, *, route_kind="rollout"):
        return native["recorded" if route_kind == "recorded" else "routes"]

    def write_recorded(self, native, recorded):
        native["recorded"] = recorded
        return native

    def seq_lens(self, native):
        return native["lens"]

    def split(self, native, num_parts, order=None):
        n = len(native["lens"])
        size = -(-n // num_parts)
        out = []
        for s in range(0, n, size):
            ids = list(range(s, min(n, s + size)))
            rec = native["recorded"].select(ids[::-1] if self.lose_order else ids)
            out.append(({"recorded": rec, "routes": None, "lens": [native["lens"][i] for i in ids]}, ids))
        return out


def _native(r, last_seen=False):
    per = []
    for i in range(r.batch_size):
        calls = r.calls[i][-1:] if last_seen else r.calls[i]
        acc = calls[0]
        for c in calls[1:]:
            acc = np.concatenate([acc, c[len(acc):]])
        rb = ReplayBatch.from_ragged([acc[:, r.moe_layer_ids]], num_experts=r.num_experts, layer_ids=r.moe_layer_ids,
                                     route_kind="rollout")
        per.append(canonical_form(rb, [len(r.tokens[i])]))
    return {"routes": ReplayBatch.concat(per), "lens": [len(t) for t in r.tokens]}


def test_good_codec_passes_and_broken_ones_fail():
    r = make_rollout(1)
    assert isinstance(_Dict(), BatchCodec)
    check_ingest(_Dict(), _native(r), r)
    with pytest.raises(AssertionError, match="sample"):
        check_ingest(_Dict(), _native(r, last_seen=True), r)
    rec = ReplayBatch.from_ragged([torch.randperm(8)[:2].expand(n, 3, 2) for n in _native(r)["lens"]],
                                  num_experts=8, layer_ids=[1, 2, 3], route_kind="recorded")
    assert check_recorded_survives_split(_Dict(), _native(r), rec, parts=(1, 2)) == 3
    with pytest.raises(AssertionError):
        check_recorded_survives_split(_Dict(lose_order=True), _native(r), rec, parts=(2,))


def test_same_targets_detects_a_difference():
    r = make_rollout(2, batch_size=4)
    a = r.expected()
    assert bool(a.valid[3]) and a.rows_per_seq[0] > 5
    v = a.valid.clone()
    v[3] = False
    b = ReplayBatch.from_packed(a.routes, a.rows_per_seq, num_experts=a.num_experts, layer_ids=a.layer_ids, valid=v,
                                route_kind="rollout")
    lens = [len(t) for t in r.tokens]
    assert check_same_targets({"a": a, "a2": a}, lens) > 0
    with pytest.raises(AssertionError, match=r"b vs a: validity differs on .* rank .*, sample 0, token 3: False vs True"):
        check_same_targets({"a": a, "b": b}, lens)
    routes = a.routes.clone()
    routes[5, 1] = torch.tensor([3, 2]) if routes[5, 1].tolist() != [3, 2] else torch.tensor([1, 0])
    c = ReplayBatch.from_packed(routes, a.rows_per_seq, num_experts=a.num_experts, layer_ids=a.layer_ids, valid=a.valid,
                                route_kind="rollout")
    sample, token = next((i, 5 - int(a.offsets[i])) for i in range(a.num_seqs) if int(a.offsets[i + 1]) > 5)
    with pytest.raises(AssertionError, match=rf"c vs a: targets differ on .*, sample {sample}, token {token}, layer 2:"):
        check_same_targets({"a": a, "c": c}, lens)
    with pytest.raises(AssertionError, match="valid"):
        assert_same_batch(b, a, "x")


def test_drop_final_invalid_rows_and_install_hook_counts():
    rb = ReplayBatch.from_ragged([torch.tensor([[[0, 1]], [[2, 3]]]), torch.tensor([[[4, 5]]])], num_experts=8,
                                 layer_ids=[0], valid=[[True, False], [True]])
    assert drop_final_invalid_rows(rb).rows_per_seq == [1, 1]

    calls = []

    class Step:
        def install(self, model, routes, seq_lens, **kw):
            calls.append((model, seq_lens, kw))
    m = torch.nn.Linear(2, 2)
    step = Step()

    def hook(c, k, args, kwargs):
        return lambda module: step.install(module, None, [k + 1], format="thd")
    with install_before_forward([m], hook, 2) as counts:
        m(torch.zeros(1, 2))
        m(torch.zeros(1, 2))
        with pytest.raises(Exception, match="only 2 micro-batches"):
            m(torch.zeros(1, 2))
    assert counts == [2] and [c[1] for c in calls] == [[1], [2]]
    m(torch.zeros(1, 2))                 # hooks removed on exit
    assert len(calls) == 2


# ---------------------------------------------------------------------------------- messages and decisions
def _shifted(rb: ReplayBatch, seq_lens, by: int) -> ReplayBatch:
    """``rb`` with every sample's routes placed ``by`` tokens late (the off-by-one codec)."""
    per = []
    for i, n in enumerate(seq_lens):
        r, v = rb.sequence(i)
        r = torch.cat([r[:1].expand(by, -1, -1), r])[: r.shape[0]]
        v = torch.cat([torch.zeros(by, dtype=torch.bool), v])[: v.shape[0]]
        per.append(canonical_form(ReplayBatch.from_ragged([r], num_experts=rb.num_experts, layer_ids=rb.layer_ids,
                                                          valid=[v], route_kind=rb.route_kind, engine=rb.engine), [n]))
    return ReplayBatch.concat(per)


@pytest.mark.parametrize("by", [1, 2])
def test_check1_names_sample_token_and_the_shift(by):
    r = make_rollout(4, batch_size=6)
    lens = [len(t) for t in r.tokens]
    native = {"routes": _shifted(r.expected(), lens, by), "lens": lens}
    with pytest.raises(AssertionError) as e:
        check_ingest(_Dict(), native, r, "toy")
    msg = str(e.value)
    rows = "row" if by == 1 else "rows"
    assert f"sample 0: routes equal the expected ones shifted by {by} {rows}" in msg, msg
    assert f"6 of 6 samples shifted by {by} {rows}" in msg, msg
    assert "sample 0, token 0: valid False, want True" in msg, msg


def test_check1_names_the_layer_of_a_wrong_route():
    r = make_rollout(5, batch_size=4)
    want = r.expected()
    routes = want.routes.clone()
    row = int(want.offsets[2]) + 1           # sample 2, token 1
    routes[row, 1] = torch.tensor([3, 1]) if routes[row, 1].tolist() != [3, 1] else torch.tensor([2, 0])
    got = ReplayBatch.from_packed(routes, want.rows_per_seq, num_experts=want.num_experts, layer_ids=want.layer_ids,
                                  valid=want.valid, route_kind="rollout")
    with pytest.raises(AssertionError, match=r"sample 2, token 1, layer 2: routes \[") as e:
        assert_same_batch(got, want, "x")
    assert "shifted" not in str(e.value)


def _rank(errors=(), coverage=0.9, rows=8, agreement=1.0, diff=0.0, last_stage=True):
    return {"r3": {"errors": list(errors), "checked_rows": 10, "metrics": {"r3bridge/coverage": coverage}},
            "r2": {"recorded_rows": [3] * rows, "agreement": agreement, "max_logprob_diff": diff, "worst_sample": 4,
                   "metrics": {}},
            "last_stage": last_stage}


def test_megatron_decisions_fail_on_each_threshold():
    from r3bridge.testing.harness.dist import Layout
    from r3bridge.testing.kit.conformance import (
        LayoutResult,
        assert_megatron_checks,
        assert_r2_passes,
        assert_r3_passes,
    )

    def result(*ranks):
        return LayoutResult(2, Layout(tp=2), list(ranks))
    assert_megatron_checks([result(_rank(), _rank())])
    with pytest.raises(AssertionError, match=r"check 4 on 2 ranks tp=2, rank 1: layer 2, micro-batch 0: sample 3"):
        assert_r3_passes(result(_rank(), _rank(errors=["layer 2, micro-batch 0: sample 3, token 4: ..."])))
    with pytest.raises(AssertionError, match="coverage 0.5 is not above 0.8"):
        assert_r3_passes(result(_rank(coverage=0.5)))
    assert_r3_passes(result(_rank(coverage=0.5)), min_coverage=0.4)
    with pytest.raises(AssertionError, match="recorded 7 sequences for 8 samples"):
        assert_r2_passes(result(_rank(rows=7)))
    with pytest.raises(AssertionError, match="agreement 0.9"):
        assert_r2_passes(result(_rank(agreement=0.9)))
    with pytest.raises(AssertionError, match="sample 4's replayed log-probs differ .* by 0.001"):
        assert_r2_passes(result(_rank(diff=1e-3)))
    with pytest.raises(AssertionError, match="last-stage rank whose runner returned no log-probs"):
        assert_r2_passes(result(_rank(diff=None)))
    with pytest.raises(AssertionError, match="no rank compared log-probs"):
        assert_r2_passes(result(_rank(diff=None, last_stage=False)))
    with pytest.raises(AssertionError, match="no layout was run"):
        assert_megatron_checks([])


def test_defaults_agree_and_the_shape_builds_both():
    from r3bridge.testing.harness.models import ModelSpec
    from r3bridge.testing.kit.rollouts import ModelShape

    spec, shape, rollout = ModelSpec(), ModelShape(), make_rollout()
    assert (rollout.num_experts, rollout.topk, rollout.num_layers) == \
        (spec.num_moe_experts, spec.moe_router_topk, spec.num_layers) == \
        (shape.num_experts, shape.topk, shape.num_layers)
    eight = ModelShape(num_experts=8, first_dense=2)
    s, r = eight.model_spec(), eight.rollout(0)
    assert (s.num_moe_experts, s.moe_layer_freq) == (8, [0, 0, 1, 1])
    assert (r.num_experts, r.moe_layer_ids, r.batch_size) == (8, [2, 3], 8)
    with pytest.raises(ValueError, match="first_dense"):
        ModelShape(first_dense=4)


def test_pack_thd_and_unpack_rows():
    from r3bridge.testing.kit.runner import pack_thd, unpack_rows

    packed = pack_thd([[5, 6, 7], [8]], vocab_size=100, align=4)
    assert packed.seq_lens == [3, 1] and packed.padded_lens == [4, 4]
    assert packed.cu_seqlens.tolist() == [0, 3, 4] and packed.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert packed.input_ids.tolist() == [6, 7, 8, 0, 9, 0, 0, 0]
    assert packed.labels.tolist()[:3] == [7, 8, 0] and packed.loss_mask.tolist()[:4] == [1, 1, 0, 0]
    rows = unpack_rows(torch.arange(8.0), packed)
    assert [x.tolist() for x in rows] == [[0.0, 1.0, 2.0], [4.0]]


def shifted_template_runner(rollout):
    """The template's runner over a batch whose routes (and validity) sit one token late: the
    off-by-one codec, seen by the router instead of by check 1."""
    from r3bridge.adapters._template import ROUTES_KEY, VALID_KEY
    from r3bridge.adapters._template.conformance_tests import TemplateRunner

    runner = TemplateRunner(rollout)
    for key in (ROUTES_KEY, VALID_KEY):
        runner.batch[key] = torch.roll(runner.batch[key], 1, dims=1)
    return runner


@pytest.mark.slow
def test_check4_fails_naming_sample_token_and_layer():
    from r3bridge.testing.kit.conformance import ONE_RANK, MegatronCase, assert_r3_passes, run_megatron_checks

    [result] = run_megatron_checks(MegatronCase(shifted_template_runner), ONE_RANK)
    with pytest.raises(AssertionError, match=r"check 4 on 1 rank, rank 0: layer [123], micro-batch 0: sample [03], "
                                             r"token \d+: router chose \[\d, \d\], want \[\d, \d\] \(\d+ of \d+ valid "
                                             r"rows differ\)"):
        assert_r3_passes(result)


def test_gpu_layouts_are_layouts_of_the_default_shape():
    from r3bridge.testing.kit.conformance import CPU_LAYOUTS, GPU_LAYOUTS, layout_name
    from r3bridge.testing.kit.rollouts import ModelShape

    shape = ModelShape()
    flags = [0] * shape.first_dense + [1] * (shape.num_layers - shape.first_dense)
    for world_size, lay in CPU_LAYOUTS + GPU_LAYOUTS:
        assert lay.dp(world_size) >= 1
        ParallelLayout(shape.num_layers, flags, tp=lay.tp, cp=lay.cp, pp=lay.pp, vpp=lay.vpp)
    assert [layout_name(w, lay) for w, lay in CPU_LAYOUTS] == ["1 rank", "2 ranks tp=2", "2 ranks cp=2",
                                                               "2 ranks pp=2 vpp=2"]


# ---------------------------------------------------------------------------------- models of any shape
def test_a_model_with_dense_layers_in_the_middle_fits_every_check():
    """Layers 1 and 4 of 6 dense: the shape builds the harness model and the rollouts alike, check 3
    derives its layouts from it, and checks 4-5's PP2 x VPP2 (6 layers do not split in 4) is
    replaced by PP2 x VPP3 and said before anything runs; a layout with no legal split is left out."""
    from r3bridge.testing.harness.dist import Layout
    from r3bridge.testing.kit.conformance import TWO_RANK, LayoutNote, default_layouts, fit_layouts
    from r3bridge.testing.kit.rollouts import ModelShape

    shape = ModelShape(num_layers=6, moe_layers=(0, 2, 3, 5))
    assert shape.moe_layer_freq == [1, 0, 1, 1, 0, 1] and shape.model_spec().moe_layer_freq == [1, 0, 1, 1, 0, 1]
    r = shape.rollout(0, batch_size=3, aborted=(1,))
    assert r.moe_layer_ids == [0, 2, 3, 5] and r.aborted == [1]
    assert all(not c[:, [1, 4]].any() for c in r.calls[0])              # dense layers: zero rows
    want = r.expected()
    assert want.topk == 2 and not bool(want.sequence(1)[1].any())        # the aborted sample: no valid row
    layouts = default_layouts(shape)
    assert any(lay.vpp == 3 for lay, _ in layouts)
    assert all(set(lay.moe_layer_ids) == {0, 2, 3, 5} for lay, _ in layouts)
    fitted, notes = fit_layouts(shape, TWO_RANK)
    assert fitted == [(2, Layout(tp=2)), (2, Layout(cp=2)), (2, Layout(pp=2, vpp=3))]
    assert len(notes) == 1 and "2 ranks pp=2 vpp=2" in notes[0] and "ran 2 ranks pp=2 vpp=3 instead" in notes[0]
    odd = ModelShape(num_layers=5, moe_layers=(0, 2, 3))
    fitted, notes = fit_layouts(odd, TWO_RANK)
    assert [lay for _, lay in fitted] == [Layout(tp=2), Layout(cp=2)] and "left out" in notes[0]
    with pytest.warns(LayoutNote, match="left out"):
        default_layouts(odd)
    with pytest.raises(ValueError, match="not both"):
        ModelShape(num_layers=6, moe_layers=(0, 2), first_dense=2)
    with pytest.raises(ValueError, match="ascending, distinct 0-based ids"):
        ModelShape(num_layers=6, moe_layers=(1, 6))


def test_check4_coverage_is_measured_against_what_the_rollout_routes():
    """Aborted samples have no route to replay: the floor is a share of the rollout's own coverage;
    a rank holding no MoE layer has nothing to check."""
    from r3bridge.testing.harness.dist import Layout
    from r3bridge.testing.kit.conformance import LayoutResult, assert_r3_passes

    def rank(coverage, expected, rows=10):
        return {"r3": {"errors": [], "checked_rows": rows, "metrics": {"r3bridge/coverage": coverage},
                       "expected_coverage": expected}}
    assert assert_r3_passes(LayoutResult(1, Layout(), [rank(0.6, 0.62)])) == 10
    with pytest.raises(AssertionError, match="coverage 0.3 is not above 0.8 of the 0.62 the rollout routes"):
        assert_r3_passes(LayoutResult(1, Layout(), [rank(0.3, 0.62)]))
    no_moe = {"r3": {"errors": [], "checked_rows": 0, "metrics": {}, "expected_coverage": None}}
    assert assert_r3_passes(LayoutResult(2, Layout(pp=2), [rank(0.9, 0.9), no_moe])) == 10


def test_check1_names_left_padding_and_one_based_layer_ids():
    """A left-padded batch read as right-padded shifts every sample by its own padding (most of a
    short sample: deeper than the old 4-row search): named as padding. Layer ids one more than the
    model's: named as 1-based."""
    r = make_rollout(4, batch_size=6)
    lens = [len(t) for t in r.tokens]
    longest = max(lens)
    want = r.expected()
    per = []
    for i, n in enumerate(lens):            # each sample's routes placed after its own left padding
        pad = longest - n
        rv, vv = want.sequence(i)
        rows = torch.cat([rv[:1].expand(pad, -1, -1), rv])[: rv.shape[0]]
        valid = torch.cat([torch.zeros(pad, dtype=torch.bool), vv])[: vv.shape[0]]
        per.append(ReplayBatch.from_ragged([rows], num_experts=want.num_experts, layer_ids=want.layer_ids,
                                           valid=[valid], route_kind="rollout"))
    assert max(longest - n for n in lens) > 4
    native = {"routes": ReplayBatch.concat(per), "lens": lens}
    with pytest.raises(AssertionError, match=r"sample 0: no routed row but at most its last, and its padding \(20 token") as e:
        check_ingest(_Dict(), native, r, "toy")
    msg = str(e.value)
    assert "5 of 6 samples ([0, 1, 2, 3, 4]) shifted each by exactly its own padding" in msg, msg
    assert "exactly the sample's padding (6 token(s) to the batch's longest sample)" not in msg   # only the first
    one_based = ReplayBatch.from_packed(want.routes, want.rows_per_seq, num_experts=want.num_experts,
                                        layer_ids=[i + 1 for i in want.layer_ids], valid=want.valid, route_kind="rollout")
    with pytest.raises(AssertionError, match=r"layer_ids: got \(2, 3, 4\), want \(1, 2, 3\); the ids are one more "
                                             r"than the model's MoE layers \[1, 2, 3\] \(1-based ids\?\)"):
        assert_same_batch(one_based, want, "x")
