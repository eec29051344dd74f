"""``adapters/_template`` is a working skeleton: a toy framework built from it passes conformance
checks 1-5.

The toy framework (what the template's comments call "your framework"): training batches are
dicts of right-padded ``[B, S, ...]`` tensors in the template codec's format, and its engine's
``forward_backward(micro_batches, forward_only)`` packs each micro-batch (THD, alignment padding
per sequence) and runs Megatron's own schedule on harness chunks through the harness forward
step. The template's ``TemplateEngineMixin`` is put in front of it, unchanged.
"""
from __future__ import annotations

import pytest
import torch

from r3bridge import ReplayBatch
from r3bridge.adapters._template import (
    ROUTES_KEY,
    SAMPLE_KEY,
    TemplateCodec,
    TemplateEngineMixin,
    TemplateRollout,
)
from r3bridge.adapters._template.codec import VALID_KEY
from r3bridge.config import Phase, ReplayConfig
from r3bridge.ingest import first_seen_rows
from r3bridge.testing.conformance import (
    CanonicalRollout,
    assert_same_batch,
    check_ingest,
    check_recorded_survives_split,
    check_same_targets,
    make_rollout,
)
from r3bridge.testing.data import PackedBatch, align_for


def toy_batch(rollout: CanonicalRollout) -> dict:
    """The toy framework's batch: the engine calls of each sample stitched first-seen (every call
    starts at row 0 here), placed from the first token; ``VALID_KEY`` marks routed tokens."""
    b, s = rollout.batch_size, max(len(t) for t in rollout.tokens)
    out = {"input_ids": torch.zeros(b, s, dtype=torch.int64), "attention_mask": torch.zeros(b, s, dtype=torch.bool),
           ROUTES_KEY: torch.zeros(b, s, rollout.num_layers, rollout.topk, dtype=torch.int32),
           VALID_KEY: torch.zeros(b, s, dtype=torch.bool)}
    for i, toks in enumerate(rollout.tokens):
        rows = torch.from_numpy(first_seen_rows(rollout.calls[i])[0].astype("int32"))
        out["input_ids"][i, :len(toks)] = torch.tensor(toks)
        out["attention_mask"][i, :len(toks)] = True
        out[ROUTES_KEY][i, :len(rows)] = rows
        out[VALID_KEY][i, :len(rows)] = True
    return out


def codec(rollout: CanonicalRollout) -> TemplateCodec:
    return TemplateCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                         num_hidden_layers=rollout.num_layers)


def _recorded(rollout: CanonicalRollout, seed: int = 3) -> ReplayBatch:
    g = torch.Generator().manual_seed(seed)
    return ReplayBatch.from_ragged(
        [torch.rand(len(t), len(rollout.moe_layer_ids), rollout.num_experts, generator=g).topk(rollout.topk, -1).indices
         for t in rollout.tokens], num_experts=rollout.num_experts, layer_ids=rollout.moe_layer_ids, source="recorded")


# ---------------------------------------------------------------------------------- checks 1-3
@pytest.mark.parametrize("seed", range(3))
def test_ingest_level_checks(seed):
    rollout = make_rollout(seed, batch_size=6)
    c = codec(rollout)
    got = check_ingest(c, toy_batch(rollout), rollout, "template")                                     # (1)
    assert check_recorded_survives_split(c, toy_batch(rollout), _recorded(rollout), parts=(1, 2, 4),     # (2)
                                         orders=(None, [5, 3, 1, 0, 2, 4])) == 1 + 2 + 3 + 1 + 2 + 3
    assert check_same_targets({"template": got, "canonical": rollout.expected()},                        # (3)
                              [len(t) for t in rollout.tokens]) > 0
    # the rollout side: the engine calls of each sample, stitched first-seen
    ingest = TemplateRollout(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids)
    from r3bridge.canonical import canonical_form
    assert_same_batch(canonical_form(ingest.routes_from_rollout(rollout.calls), [len(t) for t in rollout.tokens]),
                      rollout.expected(), "TemplateRollout")


def test_last_seen_batch_fails_check_ingest():
    """The check can fail: a batch built from each sample's *last* call (the overwrite bug)."""
    rollout = make_rollout(1, batch_size=6)
    assert any(len(c) > 1 for c in rollout.calls)
    last = CanonicalRollout(rollout.tokens, [c[-1:] for c in rollout.calls], rollout.call_tokens, rollout.prompt_lens,
                            rollout.call_prompt_lens, rollout.num_experts, rollout.num_layers, rollout.moe_layer_ids,
                            rollout.topk)
    with pytest.raises(AssertionError, match="differ"):
        check_ingest(codec(rollout), toy_batch(last), rollout)


# ---------------------------------------------------------------------------------- checks 4-5
def _pack(token_lists: list[list[int]], vocab: int, align: int) -> PackedBatch:
    """The toy framework's THD packing: each sequence padded to ``align``."""
    lens = [len(t) for t in token_lists]
    padded = [-(-n // align) * align for n in lens]
    total = sum(padded)
    ids, labels = torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64)
    mask, pos = torch.zeros(total), torch.zeros(total, dtype=torch.int64)
    off = 0
    for toks, p in zip(token_lists, padded):
        t = torch.tensor(toks) % (vocab - 1) + 1
        ids[off:off + len(t)] = t
        labels[off:off + len(t) - 1] = t[1:]
        mask[off:off + len(t) - 1] = 1.0
        pos[off:off + p] = torch.arange(p)
        off += p
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    cup = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cup[1:] = torch.cumsum(torch.tensor(padded), 0)
    return PackedBatch(lens, padded, ids, labels, mask, pos, cu, cup)


class ToyEngine:
    """The toy framework's engine: the method that runs Megatron's schedule once per pass."""

    def __init__(self, chunks, ctx) -> None:
        self.chunks, self.ctx = chunks, ctx

    def forward_backward(self, micro_batches: list[dict], forward_only: bool = False):
        from r3bridge.testing.schedule import make_forward_step, run_schedule

        vocab = self.chunks[0].vocab_size
        packed = []
        for mb in micro_batches:
            attn = mb["attention_mask"]
            packed.append(_pack([mb["input_ids"][i, :int(attn[i].sum())].tolist() for i in range(attn.shape[0])],
                                vocab, align_for(self.ctx.tp, self.ctx.cp)))
        self.packed = packed
        return run_schedule(self.chunks, packed, make_forward_step(self.ctx, thd=True, collect_logits=True),
                            forward_only=forward_only)


class R3ToyEngine(TemplateEngineMixin, ToyEngine):
    pass


class TemplateRunner:
    """:class:`r3bridge.testing.conformance.MegatronRunner` for the template on the toy engine."""

    def __init__(self, rollout: CanonicalRollout) -> None:
        self.codec = codec(rollout)
        self.batch = toy_batch(rollout)

    def attach(self, ctx, chunks, mode):
        eng = R3ToyEngine(chunks, ctx)
        eng.r3_config = ReplayConfig(replay_mode=mode)
        eng.r3_attach(chunks, self.codec)
        eng.replayer = eng.r3_runner.replayer
        return eng

    def micro_batches(self, rollout, groups, *, key):
        out = []
        for g in groups:
            t = torch.tensor(list(g))
            mb = {k: v[t] for k, v in self.batch.items()}
            mb[SAMPLE_KEY] = t
            out.append(mb)
        return out

    def run(self, eng, mbs, *, phase):
        packing = []

        def note(module, args, kwargs):
            psp = kwargs["packed_seq_params"]
            packing.append(dict(seq_lens=list(eng.packed[len(packing)].seq_lens), format="thd",
                                cu_seqlens_padded=psp.cu_seqlens_q_padded))
        h = eng.chunks[0].register_forward_pre_hook(note, with_kwargs=True)
        eng.r3_phase = Phase(phase)
        try:
            for c in eng.chunks:
                c.eval()
            res = eng.forward_backward(mbs, forward_only=True)
        finally:
            h.remove()
        per_sample = []
        for r, b in zip(res, eng.packed):           # last pipeline stage only
            for i, n in enumerate(b.seq_lens):
                off = int(b.cu_seqlens_padded[i])
                per_sample.append(r.logits[off:off + n])
        return {"logprobs": per_sample, "metrics": dict(eng.r3_result.metrics), "recorded": eng.r3_result.recorded,
                "packing": packing}

    def write_recorded(self, rollout, recorded):
        self.batch = self.codec.write_recorded(self.batch, recorded)


def _cell(ctx):
    from _megatron_checks import run_checks

    return run_checks(ctx, TemplateRunner)


@pytest.mark.slow
def test_megatron_level_checks():
    from _megatron_checks import spawn_and_check

    spawn_and_check(_cell)
