"""Route provenance on SkyRL's and AReaL's CPU paths (one rank, one process for both: start-up
dominates). verl's case runs with its engine's scenarios (tests/adapters/test_verl_engine.py).

The retraction case (miles #3277, vLLM #39917): one sample's routes came from a re-prefill while
its log-probs came from the first pass. ``count`` replays it and counts it, ``refuse`` stops before
anything is installed naming it and both provenances, matching provenance passes with 0 mismatches.

* SkyRL: its own ``MegatronModelWrapper`` schedule under r3bridge's wrapper; provenance from SkyRL's
  inference client ``weight_version`` at submit and return (``first_seen_provenance``: sample 5 straddled
  a weight sync, 3 -> 4), carried in SkyRL's real ``TrainingInputBatch`` and read per pass as
  ``PolicyWorkerMixin`` reads it.
* AReaL: r3bridge's ``WorkflowMixin`` over AReaL's resubmit loop (stand-in engine, AReaL's own
  ``ModelResponse``) whose SGLang ``meta_info`` reports ``num_retractions`` (sample 5: retracted once),
  AReaL's ``concat_padded_tensors`` / ``batched_call``, ``PPOActorMixin`` and ``MegatronEngineMixin``
  (tests/adapters/_areal_fixture.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import skyrl  # noqa: F401  (installed by `make install`: never skipped)

from r3bridge.testing.harness.dist import spawn

assert importlib.util.find_spec("areal") is not None, "areal is not installed: run `make install`"

BAD = 5
CASES = (("count", "count", True), ("refuse", "refuse", True), ("matching", "refuse", False))
PHASES = ("compute_log_prob", "update")


def _spec():
    from r3bridge.testing.harness.models import ModelSpec

    return ModelSpec(num_layers=4, moe_layer_freq=[0, 1, 1, 1], attention="identity")


def _phases(runner, target, mbs, forwards, after_refusal) -> dict:
    from r3bridge.errors import ProvenanceError

    out = {}
    for phase in PHASES:
        try:
            r = runner.run(target, mbs(), phase=phase)
            out[phase] = dict(error=None, metrics=r["metrics"], logged=r["framework_metrics"])
        except ProvenanceError as e:
            out[phase] = dict(error=str(e), forwards=len(forwards), **after_refusal())
    return out


def _skyrl(ctx, rollout) -> dict:
    from _skyrl_fixture import SkyRLRunner, training_batch

    from r3bridge.adapters.skyrl.codec import ENGINE, provenance_pairing
    from r3bridge.batch.provenance import RouteProvenance, provenance_fields
    from r3bridge.rollout.provenance import first_seen_provenance
    from r3bridge.testing.harness.models import build_model_chunks
    from r3bridge.testing.kit.conformance import GROUPS

    res = {}
    for name, check, bad in CASES:
        runner = SkyRLRunner(rollout, provenance_check=check)
        w = runner.attach(ctx, build_model_chunks(_spec(), ctx), "R3")
        batch = training_batch(rollout)
        # routes: the version when the call returned (a sync in between re-prefilled it); log-probs: at submit
        pairs = [first_seen_provenance(RouteProvenance(ENGINE, weight_version=4 if bad and i == BAD else 3),
                                       sampled_version=3) for i in range(rollout.batch_size)]
        for key, value in provenance_fields([r for r, _ in pairs], [lp for _, lp in pairs]).items():
            batch[key] = value
        forwards: list = []
        hook = w.actor_module[0].register_forward_pre_hook(lambda *a, seen=forwards: seen.append(1))

        def mbs(runner=runner, w=w, batch=batch):
            w.r3.provenance = provenance_pairing(batch)  # what PolicyWorkerMixin does per pass
            return runner.micro_batches(rollout, GROUPS, key="rollout")

        res[name] = _phases(
            runner,
            w,
            mbs,
            forwards,
            lambda w=w: dict(active=w.r3.replayer.active_pass is not None, left=w.r3.provenance is not None),
        )
        hook.remove()
    return res


def _areal(ctx, rollout) -> dict:
    import asyncio

    from _areal_fixture import (
        ArealRunner,
        FakeSGLang,
        StandInInfEngine,
        _R3Episode,
        _RemoteSGLangLike,
        model_info,
    )

    from r3bridge.testing.harness.models import build_model_chunks
    from r3bridge.testing.kit.conformance import GROUPS

    class RetractingSGLang(FakeSGLang):
        """The fake server, its meta_info as SGLang's scheduler fills it (id, weight_version, num_retractions)."""

        def __init__(self, rollout, i, retractions):
            super().__init__(rollout, i)
            self.retractions = retractions

        def generate(self, payload):
            out = super().generate(payload)
            out["meta_info"].update(id=f"rid-{self.i}", weight_version="3", num_retractions=self.retractions)
            return out

    res = {}
    for name, check, bad in CASES:
        trajs = []
        for i in range(rollout.batch_size):
            server = RetractingSGLang(rollout, i, 1 if bad and i == BAD else 0)
            wf = _R3Episode(rollout)
            wf.r3_model = model_info(rollout)
            trajs.append(asyncio.run(wf.arun_episode(_RemoteSGLangLike(StandInInfEngine(server)), {"i": i})))
        runner = ArealRunner(rollout, provenance_check=check)
        actor = runner.attach(ctx, build_model_chunks(_spec(), ctx), "R3")
        runner.trajs = trajs
        forwards: list = []
        hook = actor.engine.model[0].register_forward_pre_hook(lambda *a, seen=forwards: seen.append(1))
        eng = actor.engine
        res[name] = _phases(
            runner,
            actor,
            lambda runner=runner: runner.micro_batches(rollout, GROUPS, key="rollout"),
            forwards,
            lambda eng=eng: dict(active=eng.r3.replayer.active_pass is not None, left=eng.r3_provenance is not None),
        )
        hook.remove()
    return res


def _scenarios(ctx) -> dict:
    from r3bridge.testing.kit.conformance import make_rollout

    spec = _spec()
    rollout = make_rollout(3, batch_size=8, num_experts=spec.num_moe_experts, topk=spec.moe_router_topk)
    return {"skyrl": _skyrl(ctx, rollout), "areal": _areal(ctx, rollout)}


@pytest.fixture(scope="module")
def results() -> dict:
    return spawn(_scenarios, world_size=1, timeout=300)[0]


def _check(res: dict, routes: str, logprobs: str, differ: str) -> None:
    for phase in PHASES:
        counted = res["count"][phase]
        assert counted["error"] is None, counted["error"]
        assert counted["metrics"]["r3bridge/provenance/mismatched_samples"] == 1.0
        assert counted["metrics"]["r3bridge/provenance/checked_samples"] == 8.0
        assert counted["metrics"]["r3bridge/provenance/unchecked_samples"] == 0.0
        matching = res["matching"][phase]
        assert matching["error"] is None and matching["metrics"]["r3bridge/provenance/mismatched_samples"] == 0.0
        refused = res["refuse"][phase]
        assert refused["error"] is not None and refused["error"].startswith(f"batch row {BAD}: "), refused["error"]
        assert f"{differ} differ" in refused["error"]
        assert f"routes [{routes}]" in refused["error"] and f"log-probs [{logprobs}]" in refused["error"]
        # nothing half-applied: no forward ran, no step open, the pass's provenance not left behind
        assert (refused["forwards"], refused["active"], refused["left"]) == (0, False, False)


def test_skyrl_reprefilled_routes_are_counted_refused_or_pass(results):
    res = results["skyrl"]
    _check(
        res,
        "engine=skyrl request_id=? weight_version=4 epoch=? attempt=?",
        "engine=skyrl request_id=? weight_version=3 epoch=? attempt=?",
        "weight_version",
    )
    logged = res["count"]["update"]["logged"]  # SkyRL logs compute_log_prob's keys with the update's
    assert logged["r3bridge/update/provenance/mismatched_samples"] == 1.0
    assert logged["r3bridge/old_log_prob/provenance/mismatched_samples"] == 1.0


def test_areal_retracted_routes_are_counted_refused_or_pass(results):
    res = results["areal"]
    _check(
        res,
        "engine=sglang request_id=? weight_version=3 epoch=1 attempt=?",
        "engine=sglang request_id=? weight_version=? epoch=0 attempt=?",
        "epoch",
    )
    logged = res["count"]["update"]["logged"]  # AReaL's stats tracker, exported as AReaL does
    assert logged["r3bridge/update/provenance/mismatched_samples"] == 1.0


def test_areal_response_provenance_takes_the_first_known_output_version():
    from types import SimpleNamespace

    from r3bridge.adapters.areal.attempts import attempt_provenance

    def response_provenance(meta_info, resp):      # what the AReaL hook reads: the response's output_versions
        return attempt_provenance(meta_info, resp.output_versions, engine="sglang")

    meta = {"id": "r1", "num_retractions": 2, "weight_version": "7"}
    routes, logprobs = response_provenance(meta, SimpleNamespace(output_versions=[-1, True, 5, 6]))
    assert (routes.weight_version, routes.epoch) == (7, 2)
    assert (logprobs.request_id, logprobs.weight_version, logprobs.epoch) == ("r1", 5, 0)
    _, unknown = response_provenance({"id": "r2"}, SimpleNamespace(output_versions=None))
    assert (unknown.weight_version, unknown.epoch) == (None, None)
