"""SkyRL 0.4's transport, read and written by r3bridge's SkyRL codec against SkyRL 0.4's own code:
its generator-side ``RoutedExpertTrace`` (first-seen across turns by prompt starts), its
``convert_prompts_responses_to_batch_tensors`` (``PackedTensor`` routes) and
``make_router_padding_mask``, its ``TrainingInputBatch`` chunking / re-indexing / padding.

SkyRL 0.4 needs Python >= 3.12 to import as a package; its data-layout modules import on 3.11
through the adapter's ``import_skyrl`` (package ``__init__`` files skipped). `make install` puts the
0.4 wheel (``--no-deps``) into ``build/skyrl04`` (``R3BRIDGE_SKYRL04`` overrides), and these checks
run in a child process with it first on ``sys.path``; where SkyRL 0.4 is the installed release
(``scripts/py312/skyrl04.sh``) they run in-process.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r3bridge.errors import ConfigError, RouteShapeError

ROOT = Path(__file__).resolve().parents[2]
SK04 = os.environ.get("R3BRIDGE_SKYRL04", str(ROOT / "build" / "skyrl04"))


def _run(check: str) -> None:
    from r3bridge.adapters.skyrl import SKYRL_RELEASE
    if SKYRL_RELEASE == "0.4":
        globals()[check]()
        return
    assert (Path(SK04) / "skyrl").is_dir(), f"SkyRL 0.4 not found in {SK04} (make install puts it there)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SK04, str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert f"ok {check}" in p.stdout


# ------------------------------------------------------------------ checks (run under SkyRL 0.4)
def _sk(name):
    from r3bridge.adapters.skyrl._compat import import_skyrl
    return import_skyrl(name)


def _batch04(rollout):
    """What SkyRL 0.4's generator and trainer build from the rollout's engine calls
    (``testlab.skyrl_real.batch04``: SkyRL 0.4's RoutedExpertTrace, collation and padding mask)."""
    from testlab.skyrl_real import batch04

    tb = _sk("skyrl.backends.skyrl_train.training_batch")
    out, mask = batch04(rollout)
    batch = tb.TrainingInputBatch({"sequences": out[0], "attention_mask": out[1], "response_mask": out[2],
                                   "rollout_expert_indices": out[6], "router_padding_mask": mask})
    batch.metadata = {"uids": [str(i) for i in range(len(rollout.tokens))]}
    return batch


def _codec(rollout):
    from r3bridge.adapters.skyrl import SkyRLCodec
    return SkyRLCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                      num_hidden_layers=rollout.num_layers)


def check_release():
    from r3bridge.adapters.skyrl import SKYRL_RELEASE
    assert SKYRL_RELEASE == "0.4"
    pt = _sk("skyrl.backends.skyrl_train.utils.packed_tensor")
    assert pt.PackedTensor.__module__.startswith("skyrl.")


def check_ingest_byte_identical():
    """SkyRL 0.4's batch reads back as the canonical ReplayBatch (the one verl's and AReaL's match)."""
    import torch

    from r3bridge.testing.kit.conformance import check_ingest, make_rollout
    for seed in range(4):
        rollout = make_rollout(seed, batch_size=6)
        batch = _batch04(rollout)
        assert type(batch["rollout_expert_indices"]).__name__ == "PackedTensor"
        assert batch["rollout_expert_indices"].dtype == torch.uint8
        check_ingest(_codec(rollout), batch, rollout, f"SkyRL 0.4 seed {seed}")
        # its micro-batches too (what the worker hands the wrapper), also re-indexed
        for part, ids in _codec(rollout).split(batch, 3, order=[5, 0, 3, 1, 4, 2]):
            got = _codec(rollout).to_replay_batch(part)
            from r3bridge.testing.kit.conformance import assert_same_batch
            assert_same_batch(got, rollout.expected().select(ids), f"0.4 micro-batch {ids}")


def check_padding_rows_are_skyrls():
    """Rows without a captured route carry SkyRL's own distinct padding row and are masked."""

    from r3bridge.testing.kit.conformance import make_rollout
    rollout = make_rollout(3, batch_size=6)
    batch = _batch04(rollout)
    pt, mask, attn = batch["rollout_expert_indices"], batch["router_padding_mask"], batch["attention_mask"].bool()
    pad = _sk("skyrl.backends.skyrl_train.utils.replay_utils").replay_padding_row(rollout.topk, dtype=pt.dtype)
    uncaptured = mask[attn]
    assert bool(uncaptured.any())
    assert bool((pt.values[uncaptured] == pad).all())


def check_recorded_written_back_in_04_layout():
    """R2 routes written back as SkyRL 0.4's PackedTensor + mask survive its own chunking,
    re-indexing and batch padding, sample for sample."""
    import torch

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.testing.kit.conformance import (
        assert_same_batch,
        check_recorded_survives_split,
        make_rollout,
    )
    rollout = make_rollout(5, batch_size=6, num_experts=8)
    batch = _batch04(rollout)
    codec = _codec(rollout)
    assert codec.release == "0.4"
    lens = codec.seq_lens(batch)
    g = torch.Generator().manual_seed(0)
    recorded = ReplayBatch.from_ragged([torch.randperm(8, generator=g)[:2].expand(n, 3, 2).clone() for n in lens],
                                       num_experts=8, layer_ids=rollout.moe_layer_ids, route_kind="recorded")
    n = check_recorded_survives_split(codec, batch, recorded, parts=(1, 2, 3), orders=(None, [4, 2, 0, 5, 1, 3]))
    assert n > 0
    field = batch["rollout_expert_indices"]
    assert type(field).__name__ == "PackedTensor" and field.values.shape[1] == rollout.num_layers
    padded = _sk("skyrl.backends.skyrl_train.training_batch").pad_training_input_batch(batch, 2)
    got = codec.to_replay_batch(padded, route_kind="recorded")
    assert_same_batch(got.select(range(6)), recorded, "recorded routes after SkyRL's batch padding")
    assert not bool(got.select([6, 7]).valid.any())       # SkyRL's padding samples: no route


def check_refusals():
    from r3bridge.testing.kit.conformance import make_rollout
    rollout = make_rollout(1, batch_size=3)
    batch = _batch04(rollout)
    batch["router_padding_mask"] = None
    with pytest.raises(ConfigError, match="router_padding_mask"):
        _codec(rollout).to_replay_batch(batch)
    batch = _batch04(rollout)
    attn = batch["attention_mask"].clone()
    attn[0, -1] = 0
    with pytest.raises(RouteShapeError, match="segments"):
        _codec(rollout).to_replay_batch({"rollout_expert_indices": batch["rollout_expert_indices"],
                                         "router_padding_mask": batch["router_padding_mask"], "attention_mask": attn})


def check_first_seen_mixin_refused():
    """0.4's generator stitches first-seen itself (check_ingest_byte_identical proves it matches):
    r3bridge's 0.3 generator mixin is refused rather than stacked on top."""
    from r3bridge.adapters.skyrl import FirstSeenRoutesMixin

    class Gen(FirstSeenRoutesMixin, object):
        pass
    with pytest.raises(ConfigError, match="RoutedExpertTrace"):
        Gen()


def check_launcher_builds_skyrls_generator():
    """The launcher's experiment builds SkyRL 0.4's own generator (the 0.3 mixin would refuse to
    start), with a real tokenizer and no engine client (the generator only keeps it)."""
    import tempfile

    import r3bridge.adapters.skyrl.experiment as launcher
    from r3bridge.adapters.skyrl.config import parse_cli
    from testlab.verl_e2e import write_tokenizer

    exp = object.__new__(launcher.Exp)      # BasePPOExp.__init__ loads datasets; get_generator needs none
    gen = launcher.Exp.get_generator(exp, parse_cli([]), write_tokenizer(tempfile.mkdtemp()), None)
    assert type(gen) is launcher.SkyRLGymGenerator, type(gen).__mro__


def check_handles_written_once_04():
    """Routes by reference under SkyRL 0.4: r3bridge's RouteWriter writes 0.4's generator routes
    (``RoutedExpertTrace`` prefixes) once, the batch's ``PackedTensor`` field becomes each row's
    sample id (``router_padding_mask`` None), and SkyRL 0.4's own batch padding (its metadata
    deep-copied: the handles stay themselves), re-indexing and chunking carry the ids with their
    rows: each micro-batch's handles read the inline field's targets (SkyRL's padding rows, copies
    of row 0, read sample 0's routes, as 0.3's padding rows carry them)."""
    import tempfile

    import torch

    from r3bridge.adapters.skyrl.handles import HANDLES_KEY, RouteWriter, micro_batch_routes
    from r3bridge.config import ReplayConfig
    from r3bridge.hf import ModelInfo
    from r3bridge.parallel.layout import ParallelLayout
    from r3bridge.parallel.rank_rows import RankRows
    from r3bridge.parallel.read import read_targets
    from r3bridge.testing.kit.conformance import make_rollout
    from testlab.skyrl_real import generator_routes04

    rollout = make_rollout(7, batch_size=6)
    inline, by_ref = _batch04(rollout), _batch04(rollout)
    writer = RouteWriter(ReplayConfig(replay_mode="R3", route_transport="handles"), directory=tempfile.mkdtemp())
    model = ModelInfo(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                      num_layers=rollout.num_layers, topk=rollout.topk)
    writer.write_rollout(by_ref, generator_routes04(rollout), by_ref.metadata["uids"], step=1, model=model)
    assert by_ref["router_padding_mask"] is None and tuple(by_ref["rollout_expert_indices"].shape[2:]) == (1, 1)
    handles = by_ref.metadata[HANDLES_KEY]
    padded = _sk("skyrl.backends.skyrl_train.training_batch").pad_training_input_batch(by_ref, 2)
    assert padded.metadata[HANDLES_KEY] is handles
    layout = ParallelLayout(rollout.num_layers, [int(i in rollout.moe_layer_ids) for i in range(rollout.num_layers)])
    codec = _codec(rollout)

    def targets(routes, lens):
        return read_targets(routes, RankRows.build(layout, lens, tp_rank=0, cp_rank=0).cover(routes),
                            rollout.moe_layer_ids)

    order = [4, 6, 2, 0, 7, 5, 1, 3]
    checked = 0
    for part, ids in codec.split(padded, 3, order=order):
        want_part = codec.split(inline, 1, order=[i if i < 6 else 0 for i in ids])[0][0]
        lens = part["attention_mask"].sum(-1).tolist()
        got = targets(micro_batch_routes(part["rollout_expert_indices"], handles, lens, handles.resolvers(),
                                         route_kind="rollout"), lens)
        want = targets(codec.handed_routes(want_part), lens)
        assert torch.equal(got.valid, want.valid), ids
        for lid in rollout.moe_layer_ids:
            assert torch.equal(got.indices[lid], want.indices[lid]), (ids, lid)
        checked += int(got.valid.sum())
    assert checked > 0
    assert writer.release(1) == 6


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("check", ["check_release", "check_ingest_byte_identical", "check_padding_rows_are_skyrls",
                                   "check_recorded_written_back_in_04_layout", "check_refusals",
                                   "check_first_seen_mixin_refused", "check_launcher_builds_skyrls_generator",
                                   "check_handles_written_once_04"])
def test_skyrl04(check):
    _run(check)


def test_other_releases_refused():
    from r3bridge.adapters.skyrl import skyrl_release
    assert skyrl_release("0.3.0") == "0.3" and skyrl_release("0.4.2") == "0.4"
    assert skyrl_release("0.4.0rc1") == "0.4"                 # pre-releases of a supported release
    for v in ("0.2.9", "0.5.0", "1.0.0", "0.3.0.dev1"):
        with pytest.raises(ConfigError, match=re.escape(f"skyrl {v} is installed; r3bridge's SkyRL adapter supports "
                                                        "skyrl<0.5,>=0.3")):
            skyrl_release(v)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print(f"ok {sys.argv[1]}")
