"""The registered engine's phase logic on CPU, without a Megatron model.

``VerlSchedule`` stands in for what verl's ``MegatronEngine.forward_backward_batch`` does around
our overrides: it splits the batch with verl's own ``prepare_micro_batches`` (dynamic batch size:
samples are re-ordered), calls ``self.forward_step`` once per (chunk, micro-batch) like Megatron's
schedules, and post-processes with verl's own ``postprocess_batch_func``. ``FakeReplayer`` records
what the engine hands the driver. The real driver on the CPU Megatron harness is exercised in
``test_verl_harness.py``.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import verl  # noqa: E402,F401  (installed by `make install`: never skipped)
from _verl_batches import MOE, NUM_LAYERS, E, K, make_verl_batch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches  # noqa: E402

from r3bridge import ReplayBatch  # noqa: E402
from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, replay_batch_from_tensordict  # noqa: E402
from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine  # noqa: E402
from r3bridge.config import Action, ReplayConfig  # noqa: E402
from r3bridge.errors import ConfigError  # noqa: E402
from r3bridge.hf import ModelInfo

CHUNKS = 2          # two virtual-pipeline chunks: every micro-batch runs through both


class FakeStep:
    def __init__(self, log, action, forward_only, source, truth):
        self.log, self.action, self.forward_only, self.source, self.truth = log, Action(action), forward_only, source, truth
        self.installs = []
        self.recorded, self.metrics = None, {}

    def __enter__(self):
        self.log.append(self)
        return self

    def __exit__(self, exc_type, *a):
        self.closed = True
        if exc_type is None:
            if self.action is Action.REPLAY:       # like the driver: no agreement when recording
                self.metrics = {"r3bridge/coverage": 1.0, "r3bridge/agreement/mean": 0.9}
            if self.action is Action.RECORD:   # what the driver returns: sorted by sample id, all rows
                ids = sorted({s for i in self.installs for s in i["sample_ids"]})
                self.recorded = ReplayBatch.from_ragged([self.truth[s] for s in ids], num_experts=E,
                                                        layer_ids=MOE, source="recorded")

    def install(self, model, routes, seq_lens, *, cu_seqlens_padded=None, format="thd", seq_length=None,
                sample_ids=None):
        self.installs.append(dict(model=model, routes=routes, seq_lens=list(seq_lens), cu=cu_seqlens_padded,
                                  format=format, sample_ids=sample_ids))


class FakeReplayer:
    def __init__(self, chunks, truth=None):
        self.chunks, self.steps, self.truth = list(chunks), [], truth

    def chunk_index(self, model):
        return next(i for i, c in enumerate(self.chunks) if c is model)

    def step(self, action, *, forward_only, source=None):
        return FakeStep(self.steps, action, forward_only, source, self.truth)


class VerlSchedule(MegatronEngineWithLMHead):
    """verl's micro-batching and post-processing around ``forward_step``; no model."""

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=14)
        micro, indices = prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=False)
        outs = []
        for mb in micro:
            for chunk in self.module:
                out, _ = self.forward_step(iter([mb]), chunk, loss_function, None)
            outs.append({"model_output": out, "loss": 0.0, "metrics": {}})
        if self.fail:
            raise RuntimeError("schedule failed")
        return postprocess_batch_func(outs, indices, data) if self.last_stage else {}

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch = next(batch_iter)
        self.seen.append((model, batch))
        # "log-probs": 0.01 * token id for every packed token, nested like verl's
        ids = batch["input_ids"]
        return {"log_probs": torch.nested.nested_tensor_from_jagged(ids.values().float() * 0.01,
                                                                    offsets=ids.offsets())}, None

    def disable_adapter(self):
        return contextlib.nullcontext()


class Probe(R3BridgeMegatronEngine, VerlSchedule):
    def r3_cu_seqlens_padded(self, input_ids, model):
        lens = input_ids.offsets().diff()
        return torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])


def make_engine(mode, *, ref=False, truth=None, last_stage=True):
    eng = Probe.__new__(Probe)
    eng.engine_config = SimpleNamespace(forward_only=ref)
    eng.module = [torch.nn.Linear(1, 1) for _ in range(CHUNKS)]
    eng.seen, eng.fail, eng.last_stage = [], False, last_stage
    eng.r3_init_state(ReplayConfig(replay_mode=mode))
    eng.r3_model = ModelInfo(num_experts=E, moe_layer_ids=MOE, num_layers=NUM_LAYERS)
    if eng.r3_active:
        eng.r3_replayer = FakeReplayer(eng.module, truth)
    return eng


PL, RL = [6, 3, 4, 2, 5, 1], [5, 2, 1, 4, 3, 5]


def batch(routes=True):
    td, _ = make_verl_batch(PL, RL, seed=5)
    if not routes:
        del td[ROUTES_KEY]
    return td


def _rows_of(rb, j):
    r, v = rb.sequence(j)
    return r.clone(), v.clone()


def test_r3_replays_rollout_routes_in_log_prob_and_update():
    eng = make_engine("R3")
    td = batch()
    full = replay_batch_from_tensordict(td, moe_layer_ids=MOE, num_experts=E, source="rollout",
                                        num_hidden_layers=NUM_LAYERS)
    for forward_only in (True, False):
        eng.seen.clear()
        eng.forward_backward_batch(td, None, forward_only=forward_only)
        step = eng.r3_replayer.steps[-1]
        assert (step.action, step.forward_only, step.source) == (Action.REPLAY, forward_only, "rollout")
        # exactly one install per (chunk, micro-batch), right before that chunk's forward
        assert len(step.installs) == len(eng.seen)
        sample_of = {}
        for inst, (model, mb) in zip(step.installs, eng.seen):
            assert inst["model"] is model and inst["format"] == "thd"
            assert inst["seq_lens"] == mb["input_ids"].offsets().diff().tolist()
            # the micro-batch's routes are its own samples' rows, whatever order verl chose
            lens = mb["input_ids"].offsets().diff().tolist()
            got = inst["routes"]
            assert got.source == "rollout" and got.num_seqs == len(lens)
            for j in range(got.num_seqs):
                r, v = _rows_of(got, j)
                matches = [i for i in range(full.num_seqs)
                           if full.rows_per_seq[i] == r.shape[0] and torch.equal(_rows_of(full, i)[0], r)]
                assert len(matches) == 1
                sample_of[(id(mb), j)] = matches[0]
        assert sorted(set(sample_of.values())) == list(range(len(PL)))
    assert SAMPLE_KEY not in td.keys()


def _truth(td, seed=2):
    rng = np.random.default_rng(seed)
    return [np.stack([np.stack([rng.choice(E, K, replace=False) for _ in MOE]) for _ in range(n)])
            for n in td["input_ids"].offsets().diff().tolist()]


def test_r2_records_then_replays_its_own_routes_per_sample():
    td = batch(routes=False)
    truth = _truth(td)
    eng = make_engine("R2", truth=truth)
    out = eng.forward_backward_batch(td, None, forward_only=True)           # compute_log_prob
    rec_step = eng.r3_replayer.steps[-1]
    assert rec_step.action is Action.RECORD and rec_step.forward_only
    ids = [s for i in rec_step.installs for s in i["sample_ids"]]
    assert sorted(set(ids)) == list(range(len(PL))) and all(i["routes"] is None for i in rec_step.installs)
    assert SAMPLE_KEY not in td.keys()
    routes = out["model_output"][ROUTES_KEY]
    assert routes.is_nested and routes.dtype == torch.int16
    for i, t in enumerate(routes.unbind()):                                  # original sample order
        assert torch.equal(t.long(), torch.from_numpy(truth[i]).long())
    # verl's trainer puts the output into the batch; the update re-partitions it
    td[ROUTES_KEY] = routes
    upd = eng.forward_backward_batch(td, None, forward_only=False)
    step = eng.r3_replayer.steps[-1]
    assert (step.action, step.source) == (Action.REPLAY, "recorded")
    for inst in step.installs:
        rb = inst["routes"]
        assert rb.source == "recorded"
        for j in range(rb.num_seqs):
            r, v = _rows_of(rb, j)
            assert bool(v.all()) and any(torch.equal(r.long(), torch.from_numpy(t).long()) for t in truth)
    # compute_log_prob's metrics are reported with the update (verl drops compute_log_prob metrics)
    m = upd["metrics"]
    assert "r3bridge/update/coverage" in m and "r3bridge/update/agreement/mean" in m
    assert not any(k.startswith("r3bridge/old_log_prob/") for k in m)        # RECORD has no agreement


def test_reference_passes_never_replay():
    ref = make_engine("R3", ref=True)
    assert ref.r3_replayer is None and not ref.r3_active
    ref.forward_backward_batch(batch(), None, forward_only=True)             # no replayer at all
    eng = make_engine("R3")
    with eng.disable_adapter():                                               # LoRA ref inside the actor
        eng.forward_backward_batch(batch(), None, forward_only=True)
    assert eng.r3_replayer.steps == []
    eng.forward_backward_batch(batch(), None, forward_only=True)
    assert len(eng.r3_replayer.steps) == 1
    off = make_engine("off")
    off.forward_backward_batch(batch(), None, forward_only=False)
    assert off.r3_replayer is None


def test_missing_or_conflicting_routes_are_config_errors():
    td = batch(routes=False)
    with pytest.raises(ConfigError, match="enable_rollout_routing_replay"):
        make_engine("R3").forward_backward_batch(td, None, forward_only=True)
    with pytest.raises(ConfigError, match="bypass_mode"):
        make_engine("R2").forward_backward_batch(td, None, forward_only=False)
    with pytest.raises(ConfigError, match="already carries"):
        make_engine("R2").forward_backward_batch(batch(), None, forward_only=True)


def test_mismatch_metrics_and_other_stages():
    from verl.workers.utils.padding import no_padding_2_padding

    import r3bridge.metrics  # noqa: F401
    from r3bridge.metrics import logprob_mismatch

    td = batch()
    resp = td["responses"].float() * 0.01
    td["rollout_log_probs"] = resp + 0.05 * td["response_mask"]
    eng = make_engine("R3")
    eng.forward_backward_batch(td, None, forward_only=True)
    upd = eng.forward_backward_batch(td, None, forward_only=False)
    m = upd["metrics"]
    logp = torch.nested.nested_tensor_from_jagged(td["input_ids"].values().float() * 0.01,
                                                  offsets=td["input_ids"].offsets())
    train = no_padding_2_padding(logp, td).float()
    want = logprob_mismatch(train, td["rollout_log_probs"], td["response_mask"].bool(), exclude_last=False,
                            prefix="r3bridge/old_log_prob/")
    for k, v in want.items():
        assert m[k] == [pytest.approx(v)]
    assert m["r3bridge/old_log_prob/coverage"] == [1.0] and "r3bridge/update/mismatch/k3_kl" in m
    # TransferQueue mode keeps per-response fields nested: same numbers
    lens = td["response_mask"].sum(1)
    for key in ("rollout_log_probs", "response_mask"):
        dense = td[key]
        td[key] = torch.nested.as_nested_tensor([dense[i, :n] for i, n in enumerate(lens.tolist())],
                                                layout=torch.jagged)
    eng.forward_backward_batch(td, None, forward_only=True)
    m2 = eng.forward_backward_batch(td, None, forward_only=False)["metrics"]
    for k, v in want.items():
        assert m2[k] == [pytest.approx(v)]
    # a rank that is not the last pipeline stage gets no output from verl: nothing to add
    mid = make_engine("R3", last_stage=False)
    assert mid.forward_backward_batch(batch(), None, forward_only=True) == {}


def test_schedule_failure_frees_state():
    td = batch(routes=False)
    eng = make_engine("R2", truth=_truth(td))
    eng.fail = True
    with pytest.raises(RuntimeError, match="schedule failed"):
        eng.forward_backward_batch(td, None, forward_only=True)
    assert eng.r3_replayer.steps[-1].closed and eng._r3_step is None and SAMPLE_KEY not in td.keys()
    eng.fail = False
    assert eng.forward_backward_batch(td, None, forward_only=True)["model_output"][ROUTES_KEY] is not None
