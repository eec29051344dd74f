"""SkyRL's routes by reference (``route_transport: handles``, adapters/skyrl/handles.py): the
trainer's RouteWriter writes each sample of SkyRL's own ``TrainingInputBatch`` once, the batch
carries sample ids and handles, and a worker micro-batch's routes read through the handles give
every rank exactly the targets the inline field gives; a missing, truncated or changed object
fails closed naming SkyRL's sample; a step's routes go when it ends, stale runs at start. The
whole job path (SkyRL's wrapper, R3 and R2, PP2 x VPP2) runs in test_skyrl_real.py."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from r3bridge.adapters.skyrl import SkyRLReplay, codec
from r3bridge.adapters.skyrl.handles import HANDLES_KEY, RouteWriter, micro_batch_routes
from r3bridge.config import ReplayConfig
from r3bridge.errors import ConfigError, DegenerateRouteError
from r3bridge.handles import RouteHandleError
from r3bridge.hf import ModelInfo
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.read import read_targets
from r3bridge.testing.kit.conformance import make_rollout
from testlab.skyrl_real import generator_routes, training_input

E, K, MOE = 8, 2, [1, 2, 3]
HF = {"num_hidden_layers": 4, "num_experts": E, "num_experts_per_tok": K, "mlp_only_layers": [0]}
ORDER = [5, 1, 0, 4, 2, 7, 3, 6]       # the update's sample order (SkyRL's shuffle / dynamic sampling)


def _config(tmp_path, **kw):
    return ReplayConfig(replay_mode="R3", route_transport="handles", **kw)


def _batches(tmp_path, **cfg):
    """(the inline batch, the same batch with handles, the writer)."""
    rollout = make_rollout(21, batch_size=8, num_experts=E, topk=K, num_layers=4, moe_layer_ids=MOE)
    inline, by_ref = training_input(rollout), training_input(rollout)
    writer = RouteWriter(_config(tmp_path, **cfg), directory=str(tmp_path / "routes"))
    writer.write_rollout(by_ref, generator_routes(rollout), by_ref.metadata["uids"], step=3,
                         model=ModelInfo.from_hf_config(HF))
    return inline, by_ref, writer


def _rows(batch, rows):
    return {k: batch[k][torch.tensor(rows)] for k in ("attention_mask", codec.ROUTES_KEY)}


def _targets(handed, lens, layout, **ranks):
    rank_rows = RankRows.build(layout, lens, tp_rank=ranks.get("tp_rank", 0), cp_rank=ranks.get("cp_rank", 0))
    return read_targets(handed, rank_rows.cover(handed), layout.moe_layers(ranks.get("pp_rank", 0), 0))


def _handle_routes(by_ref, rows, resolvers):
    mb = _rows(by_ref, rows)
    lens = mb["attention_mask"].sum(-1).tolist()
    return micro_batch_routes(mb[codec.ROUTES_KEY], by_ref.metadata[HANDLES_KEY], lens, resolvers,
                              route_kind="rollout"), lens


def test_handles_give_each_rank_the_inline_targets(tmp_path):
    inline, by_ref, writer = _batches(tmp_path)
    field = by_ref[codec.ROUTES_KEY]
    assert tuple(field.shape) == (8, 1, 1, 1) and field.dtype == torch.int32     # one sample id a row, no routes
    handles = by_ref.metadata[HANDLES_KEY]
    assert handles.step == 3 and len(handles.handles) == 8
    assert repr(handles) == f"BatchHandles(run {handles.run_id} step 3: 8 samples in files {tmp_path / 'routes'})"
    assert sum(len(f) for _, _, f in os.walk(tmp_path / "routes")) == 8          # written once per sample
    resolvers = handles.resolvers()
    for layout in (ParallelLayout(4, [0, 1, 1, 1], tp=2), ParallelLayout(4, [0, 1, 1, 1], cp=2),
                   ParallelLayout(4, [0, 1, 1, 1], pp=2)):
        for group in (ORDER[:4], ORDER[4:]):
            got_routes, lens = _handle_routes(by_ref, group, resolvers)
            want_routes = codec.handed_routes(_rows(inline, group), num_experts=E, moe_layer_ids=MOE,
                                              num_hidden_layers=4)
            for ranks in ({"tp_rank": r} for r in range(layout.tp)) if layout.tp > 1 else \
                    ({"cp_rank": r} for r in range(layout.cp)) if layout.cp > 1 else \
                    ({"pp_rank": r} for r in range(layout.pp)):
                got, want = _targets(got_routes, lens, layout, **ranks), _targets(want_routes, lens, layout, **ranks)
                assert got.layer_ids == want.layer_ids and torch.equal(got.valid, want.valid)
                for lid in got.layer_ids:
                    assert torch.equal(got.indices[lid], want.indices[lid]), (layout, ranks, lid)
                assert got.valid.any()


def test_padding_micro_batch_reads_no_route(tmp_path):
    """SkyRL's token-based micro-batching pads with a zero field (no sample): no route, nothing read."""
    _, by_ref, _ = _batches(tmp_path)
    mb = _rows(by_ref, [2, 2])
    mb[codec.ROUTES_KEY][1] = 0
    lens = mb["attention_mask"].sum(-1).tolist()
    handed = micro_batch_routes(mb[codec.ROUTES_KEY], by_ref.metadata[HANDLES_KEY], lens,
                                by_ref.metadata[HANDLES_KEY].resolvers(), route_kind="rollout")
    assert handed.names[1] == "padding row 1"
    t = _targets(handed, lens, ParallelLayout(4, [0, 1, 1, 1]))
    assert t.valid[: lens[0]].any() and not t.valid[lens[0]:].any()


def _damage(path, how):
    if how == "missing":
        os.unlink(path)
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 7)
    else:                                    # one route id changed in place
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("how", ["missing", "truncated", "changed"])
def test_damaged_routes_fail_closed_naming_skyrls_sample(tmp_path, how):
    _, by_ref, writer = _batches(tmp_path)
    handles = by_ref.metadata[HANDLES_KEY]
    victim = handles.handles[4]
    _damage(writer.store.backend.path(victim.key), how)
    handed, lens = _handle_routes(by_ref, [1, 4], handles.resolvers())
    with pytest.raises(RouteHandleError) as e:
        _targets(handed, lens, ParallelLayout(4, [0, 1, 1, 1]))
    msg = str(e.value)
    assert "sample 'row4-uid4'" in msg and f"run {writer.store.run_id} step 3" in msg, msg
    if how == "changed":
        assert "layer 3" in msg and "do not match their digest" in msg, msg


def test_lifetime_release_keep_and_stale_runs(tmp_path):
    routes = tmp_path / "routes"
    stale, live = routes / "deadrun" / "1", routes / "liverun" / "1"
    for d in (stale, live):
        d.mkdir(parents=True)
        (d / "x.routes").write_bytes(b"x")
    old = time.time() - 7 * 3600
    os.utime(stale / "x.routes", (old, old))
    _, _, writer = _batches(tmp_path)
    assert not (routes / "deadrun").exists() and (live / "x.routes").exists()     # stale removed at start
    run = routes / writer.store.run_id
    assert len(os.listdir(run / "3")) == 8
    assert writer.release(3) == 8 and not run.exists()                            # the step's routes go
    _, _, kept = _batches(tmp_path, trace_dir=str(tmp_path / "traces"))
    assert kept.release(3) == 0 and len(os.listdir(routes / kept.store.run_id / "3")) == 8   # kept for traces


def test_settings_refused_or_contradicted():
    from r3bridge.adapters.skyrl.config import command_line_section

    rc, _ = command_line_section(["trainer.r3bridge.route_transport=handles", "trainer.r3bridge.route_store=ray"])
    assert (rc.route_transport, rc.route_store) == ("handles", "ray")
    with pytest.raises(ConfigError, match="route_store must be a folder path or 'ray', got ' '"):     # at launch
        command_line_section(["trainer.r3bridge.route_transport=handles", "trainer.r3bridge.route_store=' '"])
    inline = SkyRLReplay([], ReplayConfig(replay_mode="off"), ModelInfo.from_hf_config(HF))
    with pytest.raises(ConfigError, match="the batch carries route handles, this worker's r3bridge.route_transport "
                                          "is 'inline'"):
        with inline.handles_from({HANDLES_KEY: object()}):
            pass
    SkyRLReplay([], ReplayConfig(replay_mode="off", route_transport="handles"), ModelInfo.from_hf_config(HF))


def test_a_zero_row_is_a_degenerate_route_named_with_skyrls_sample(tmp_path):
    """The generator's rows are all routes (no zero-row "no route" outside SkyRL 0.3's dense field):
    an all-zero row (vLLM #54730) is read as a route whose ids repeat, refused naming the sample."""
    rollout = make_rollout(3, batch_size=2, num_experts=E, topk=K, num_layers=4, moe_layer_ids=MOE)
    batch = training_input(rollout)
    routes = generator_routes(rollout)
    routes[1] = np.asarray(routes[1])
    routes[1][2] = 0
    writer = RouteWriter(_config(tmp_path), directory=str(tmp_path / "routes"))
    writer.write_rollout(batch, routes, batch.metadata["uids"], step=0, model=ModelInfo.from_hf_config(HF))
    handed, lens = _handle_routes(batch, [0, 1], batch.metadata[HANDLES_KEY].resolvers())
    with pytest.raises(DegenerateRouteError, match=r"row1-uid1"):
        _targets(handed, lens, ParallelLayout(4, [0, 1, 1, 1]))


# ---------------------------------------------------------------------------------- the trainer
class TrainerSteps:
    """Stand-in for SkyRL 0.3's ``RayPPOTrainer`` (its module does not import on Python 3.11:
    pydantic refuses ``typing.TypedDict`` in ``skyrl.tinker.types``): the calls ``TrainerMixin``
    overrides, in SkyRL's order, on SkyRL's own batch code (``convert_prompts_responses_to_batch_tensors``,
    ``TrainingInputBatch.select`` keeping only ``response_length`` of the metadata for the forward
    passes, as ``fwd_logprobs_values_reward`` does). ``dispatch``: records what each model's
    workers get and answers with ``answer``."""

    def __init__(self, answer=None):
        from types import SimpleNamespace as NS

        self.cfg = NS(trainer=NS(policy=NS(model=NS(path=HF)), recompute_old_logprobs_per_minibatch=False))
        self.global_step = 1
        self.seen: list = []
        answer = answer or (lambda data: [{"logprobs": [0.0]} for _ in range(data.batch_size)])
        self.dispatch = NS(forward=lambda model, data: (self.seen.append((model, data)),
                                                       NS(loss_fn_outputs=answer(data)))[1])

    def convert_to_training_input(self, generator_output, uids):
        from r3bridge.adapters.skyrl._compat import import_skyrl

        pre = import_skyrl("skyrl.train.dataset.preprocess")
        tb = import_skyrl("skyrl.backends.skyrl_train.training_batch")
        g = generator_output
        seqs, attn, resp, rewards, loss, _, rei = pre.convert_prompts_responses_to_batch_tensors(
            type("Tok", (), {"pad_token_id": 0})(), g["prompt_token_ids"], g["response_ids"], g["rewards"],
            g["loss_masks"], None, g.get("rollout_expert_indices"))
        batch = tb.TrainingInputBatch({"sequences": seqs, "attention_mask": attn, "response_mask": resp,
                                       "loss_mask": loss, "rewards": rewards, "rollout_expert_indices": rei})
        batch.metadata = {"uids": list(uids), "response_length": int(resp.shape[1])}
        return batch

    def _execute_forward_pass(self, model, data_fwd_pass, key, mini_batch_boundaries):
        self.dispatch.forward(model, data_fwd_pass)
        return torch.zeros(data_fwd_pass.batch_size, 1)

    def fwd_logprobs_values_reward(self, training_input):
        keys = ["sequences", "attention_mask"] + (["rollout_expert_indices"]
                                                  if training_input.get("rollout_expert_indices") is not None else [])
        data = training_input.select(keys=keys, metadata_keys=["response_length"])
        self._execute_forward_pass("ref", data, key="logprobs", mini_batch_boundaries=None)
        self._execute_forward_pass("policy", data, key="logprobs", mini_batch_boundaries=None)
        return training_input

    def train_critic_and_policy(self, data):
        raise RuntimeError("the policy worker died")     # the step fails: its routes go all the same


def _trainer(tmp_path, mode, answer=None):
    from r3bridge.adapters.skyrl import TrainerMixin

    cls = type("HarnessTrainer", (TrainerMixin, TrainerSteps),
               {"r3_config": ReplayConfig(replay_mode=mode, route_transport="handles"),
                "r3_routes_dir": str(tmp_path / "routes")})
    return cls(answer)


def _generator_output(rollout):
    return {"prompt_token_ids": [t[:p] for t, p in zip(rollout.tokens, rollout.prompt_lens)],
            "response_ids": [t[p:] for t, p in zip(rollout.tokens, rollout.prompt_lens)],
            "rewards": [[0.0] * (len(t) - p) for t, p in zip(rollout.tokens, rollout.prompt_lens)],
            "loss_masks": [[1] * (len(t) - p) for t, p in zip(rollout.tokens, rollout.prompt_lens)],
            "rollout_expert_indices": generator_routes(rollout)}


def test_trainer_writes_once_carries_handles_to_the_policy_and_releases(tmp_path):
    rollout = make_rollout(21, batch_size=8, num_experts=E, topk=K, num_layers=4, moe_layer_ids=MOE)
    t = _trainer(tmp_path, "R3")
    out = _generator_output(rollout)
    batch = t.convert_to_training_input(out, [f"p{i // 2}" for i in range(8)])
    assert out["rollout_expert_indices"] is not None                  # the generator's output left as it was
    field, handles = batch["rollout_expert_indices"], batch.metadata[HANDLES_KEY]
    assert tuple(field.shape[2:]) == (1, 1) and [h.sample for h in handles.handles][:3] == \
        ["row0-uidp0", "row1-uidp0", "row2-uidp1"]
    run = tmp_path / "routes" / handles.run_id / "1"
    assert len(os.listdir(run)) == 8
    t.fwd_logprobs_values_reward(batch)
    (ref_model, ref_data), (policy_model, policy_data) = t.seen
    # SkyRL's select dropped the handles; the policy's forward gets them back, the reference never
    assert (ref_model, policy_model) == ("ref", "policy")
    assert HANDLES_KEY not in ref_data.metadata and policy_data.metadata[HANDLES_KEY] is handles
    with pytest.raises(RuntimeError, match="worker died"):
        t.train_critic_and_policy(batch)
    assert not run.exists()                                           # released with the failed step


def test_trainer_r2_stores_the_recording_once(tmp_path):
    from r3bridge.adapters.skyrl.hooks import RECORDED_KEY
    from r3bridge.batch.recorded import per_sample_payloads
    from r3bridge.batch.schema import ReplayBatch

    rollout = make_rollout(5, batch_size=4, num_experts=E, topk=K, num_layers=4, moe_layer_ids=MOE)
    rng = np.random.default_rng(0)
    lens = [len(tk) for tk in rollout.tokens]
    recorded = ReplayBatch.from_ragged([np.argsort(rng.random((n, 3, E)), -1)[..., :K] for n in lens], num_experts=E,
                                       layer_ids=MOE, route_kind="recorded")
    payloads = per_sample_payloads(recorded)
    t = _trainer(tmp_path, "R2", answer=lambda data: [{"logprobs": [0.0], RECORDED_KEY: p} for p in payloads],
)
    out = _generator_output(rollout)
    out["rollout_expert_indices"] = None                               # R2: no rollout routes
    batch = t.fwd_logprobs_values_reward(t.convert_to_training_input(out, ["a", "b", "c", "d"]))
    handles = batch.metadata[HANDLES_KEY]
    assert batch.metadata[codec.ROUTES_MARK] == "recorded" and [h.route_kind for h in handles.handles] == \
        ["recorded"] * 4 and [h.rows for h in handles.handles] == lens
    mb = {k: batch[k][torch.tensor([3, 0])] for k in ("attention_mask", codec.ROUTES_KEY)}
    handed = micro_batch_routes(mb[codec.ROUTES_KEY], handles, [lens[3], lens[0]], handles.resolvers(),
                                route_kind="recorded")
    t_got = _targets(handed, [lens[3], lens[0]], ParallelLayout(4, [0, 1, 1, 1]))
    want = recorded.select([3, 0])
    for j, lid in enumerate(MOE):
        assert torch.equal(t_got.indices[lid].sort(1).values, want.routes[:, j].long().sort(1).values)


def _worker_targets(batch, rows):
    """In a Ray worker process: the policy worker's read of micro-batch ``rows`` of ``batch`` (its
    fields and metadata, as SkyRL's dispatch hands them over: SkyRL's ``TrainingInputBatch`` class
    itself does not import on Python 3.11 outside r3bridge's ``import_skyrl``)."""
    mb = _rows(batch, rows)
    handles = batch["metadata"][HANDLES_KEY]
    lens = mb["attention_mask"].sum(-1).tolist()
    handed = micro_batch_routes(mb[codec.ROUTES_KEY], handles, lens, handles.resolvers(), route_kind="rollout")
    t = _targets(handed, lens, ParallelLayout(4, [0, 1, 1, 1], pp=2), pp_rank=1)
    return t.valid, {lid: t.indices[lid] for lid in t.layer_ids}


@pytest.mark.slow
def test_ray_store_reaches_another_process(tmp_path):
    """``route_store: ray``: the driver's handles travel in the batch's metadata to a Ray worker
    process (pickled by Ray, their object references counted), which reads its stage's layers
    from Ray's object store: the inline field's targets."""
    import ray

    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {
                 "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(here)), here]),
                 "OMP_NUM_THREADS": "1"}})
    try:
        rollout = make_rollout(21, batch_size=8, num_experts=E, topk=K, num_layers=4, moe_layer_ids=MOE)
        inline, by_ref = training_input(rollout), training_input(rollout)
        writer = RouteWriter(ReplayConfig(replay_mode="R3", route_transport="handles", route_store="ray"))
        writer.write_rollout(by_ref, generator_routes(rollout), by_ref.metadata["uids"], step=2,
                             model=ModelInfo.from_hf_config(HF))
        assert by_ref.metadata[HANDLES_KEY].store == "ray" and not os.path.exists(tmp_path / "routes")
        sent = {k: by_ref[k] for k in ("attention_mask", codec.ROUTES_KEY)} | {"metadata": by_ref.metadata}
        valid, indices = ray.get(ray.remote(_worker_targets).remote(ray.put(sent), ORDER[:4]))
        mb = _rows(inline, ORDER[:4])
        want = _targets(codec.handed_routes(mb, num_experts=E, moe_layer_ids=MOE, num_hidden_layers=4),
                        mb["attention_mask"].sum(-1).tolist(), ParallelLayout(4, [0, 1, 1, 1], pp=2), pp_rank=1)
        assert want.valid.any() and torch.equal(valid, want.valid) and sorted(indices) == list(want.layer_ids)
        for lid in want.layer_ids:
            assert torch.equal(indices[lid], want.indices[lid]), lid
        assert writer.release(2) == 8
    finally:
        ray.shutdown()
