"""The conformance suite itself: canonical rollouts exercise what it claims, and broken adapters fail."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from r3bridge import ReplayBatch
from r3bridge.canonical import canonical_form, drop_final_invalid_rows
from r3bridge.megatron.phase import install_before_forward
from r3bridge.protocols import BatchCodec
from r3bridge.testing.conformance import (
    assert_same_batch,
    check_ingest,
    check_recorded_survives_split,
    check_same_targets,
    make_rollout,
)


def test_rollouts_cover_the_hard_cases():
    r = make_rollout(0, batch_size=9)
    want = r.expected()
    assert want.source == "rollout" and want.layer_ids == (1, 2, 3)
    assert any(len(c) > 1 for c in r.calls)                                  # multi-turn / resubmits
    assert any(r.call_prompt_lens[i][t + 1] == len(r.call_tokens[i][t])      # a resubmit
               for i in range(9) for t in range(len(r.calls[i]) - 1))
    assert not bool(want.valid.all())                                         # unrouted tails
    for i in range(9):                                                        # dense layer 0 is zero in the engine
        assert all(not c[:, 0].any() for c in r.calls[i])
        assert want.rows_per_seq[i] in (len(r.tokens[i]) - 1, len(r.tokens[i]))


class _Dict:
    """A minimal BatchCodec over {"routes": ReplayBatch, "lens": [...]} (what a correct adapter does)."""

    def __init__(self, lose_order=False, last_seen=False):
        self.lose_order, self.last_seen = lose_order, last_seen

    def to_replay_batch(self, native, *, source="rollout"):
        return native["recorded" if source == "recorded" else "routes"]

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
                                     source="rollout")
        per.append(canonical_form(rb, [len(r.tokens[i])]))
    return {"routes": ReplayBatch.concat(per), "lens": [len(t) for t in r.tokens]}


def test_good_codec_passes_and_broken_ones_fail():
    r = make_rollout(1)
    assert isinstance(_Dict(), BatchCodec)
    check_ingest(_Dict(), _native(r), r)
    with pytest.raises(AssertionError, match="sample"):
        check_ingest(_Dict(), _native(r, last_seen=True), r)
    rec = ReplayBatch.from_ragged([torch.randperm(8)[:2].expand(n, 3, 2) for n in _native(r)["lens"]],
                                  num_experts=8, layer_ids=[1, 2, 3], source="recorded")
    assert check_recorded_survives_split(_Dict(), _native(r), rec, parts=(1, 2)) == 3
    with pytest.raises(AssertionError):
        check_recorded_survives_split(_Dict(lose_order=True), _native(r), rec, parts=(2,))


def test_same_targets_detects_a_difference():
    r = make_rollout(2, batch_size=4)
    a = r.expected()
    v = a.valid.clone()
    v[3] = False
    b = ReplayBatch.from_packed(a.routes, a.rows_per_seq, num_experts=8, layer_ids=a.layer_ids, valid=v, source="rollout")
    lens = [len(t) for t in r.tokens]
    assert check_same_targets({"a": a, "a2": a}, lens) > 0
    with pytest.raises(AssertionError, match="differ"):
        check_same_targets({"a": a, "b": b}, lens)
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
