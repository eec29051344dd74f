"""verl adapter on a real megatron-core model (CPU harness), conformance checks 4 and 5
(:class:`r3bridge.testing.kit.suite.BaseMegatronTests`).

The engine is the adapter's ``R3BridgeMegatronEngine`` with only verl's schedule call and model
forward stood in for (``tests/adapters/_verl_runner.py``): verl's own micro-batching, batch
generator and THD packing (``preprocess_thd_engine``) feed megatron's schedule; the adapter's
``forward_backward_batch``, ``forward_step`` override and ``r3_install`` run unchanged. Layouts:
TP2 + SP, CP2 (zigzag), PP2 x VPP2, like every packed-THD adapter. The update passes run
forward and backward (verl's engine picks the phase from ``forward_only``).
"""
from __future__ import annotations

import pytest
import verl  # noqa: F401  (installed by `make install`: never skipped)
from _verl_runner import VerlFixtures

from r3bridge.testing.kit.conformance import REGROUPED
from r3bridge.testing.kit.suite import BaseMegatronTests


def r3_update_after_checks(ctx, runners) -> dict:
    """The R3 engine's next update: the compute_log_prob metrics verl's trainer drops come with it."""
    r3 = runners[0]
    update = r3.run(r3.engine, r3.micro_batches(r3.rollout, REGROUPED, key="rollout"), phase="update")
    return {"metrics": update["metrics"], "framework_metrics": update["framework_metrics"]}


@pytest.mark.slow
class TestVerlMegatron(BaseMegatronTests, VerlFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def reader_form(cls):
        return "packed/zero/rollout"      # the one reader reads this adapter's own buffer, per micro-batch

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_extras(cls):
        return r3_update_after_checks

    def test_metrics_reach_verl(self, megatron_results):
        for result in megatron_results:
            assert any(r["last_stage"] for r in result.ranks)
            for r in result.ranks:
                logged, r3_logged = r["r2"]["framework_metrics"], r["extras"]["framework_metrics"]
                if not r["last_stage"]:
                    assert logged is None and r3_logged is None      # verl returns outputs from the last stage only
                    continue
                # r3bridge's metrics reach verl's output["metrics"] (lists, as verl's trainer reduces
                # them), tagged by phase
                assert logged["r3bridge/update/agreement/mean"] == [pytest.approx(1.0)], logged
                assert logged["r3bridge/update/coverage"] == [pytest.approx(r["r2"]["metrics"]["r3bridge/coverage"])]
                # R3: compute_log_prob's metrics are held and logged with the next update, next to its own
                cov = r["r3"]["metrics"]["r3bridge/coverage"]
                assert r3_logged["r3bridge/old_log_prob/coverage"] == [pytest.approx(cov)], r3_logged
                assert r3_logged["r3bridge/old_log_prob/agreement/mean"] == \
                    [pytest.approx(r["r3"]["metrics"]["r3bridge/agreement/mean"])]
                assert r3_logged["r3bridge/update/coverage"] == [pytest.approx(cov)]    # same routes, regrouped
                assert r3_logged["r3bridge/update/coverage"] == \
                    [pytest.approx(r["extras"]["metrics"]["r3bridge/coverage"])]
