"""r3bridge's metrics through each framework's own reduction (docs/metrics.md, "Aggregation").

Two update passes (mini-batches) of real driver metrics (``AgreementCounter`` -> ``summarize_layers``
-> ``tag_phase``, what :class:`r3bridge.session.PhaseRunner` hands the adapters) go through verl's
append-list convention and ``reduce_metrics``, SkyRL's ``reduce_metrics`` and AReaL's stats tracker
(as the AReaL adapter logs into it). Every framework must give the documented value of every key:
counts and ratios as the mean per pass, ``*_min`` as the minimum over passes, under the same names.
"""
from __future__ import annotations

import math

import pytest
import torch

from r3bridge.metrics import WORST_LAYERS, summarize_layers, tag_phase
from r3bridge.metrics.agreement import AgreementCounter

PREFIX = "r3bridge/"
LAYERS = list(range(1, 49))          # 48 MoE layers, as in the count of 118 keys


def _pass(seed: int, rows: int) -> dict[str, float]:
    """One update pass's tagged metrics from a counter fed like the router hook feeds it."""
    gen = torch.Generator().manual_seed(seed)
    counter = AgreementCounter(LAYERS)
    for lid in LAYERS:
        native = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(rows)])
        replayed = native.clone()
        flip = torch.rand(rows, generator=gen) < 0.05 * (1 + lid % 4)
        replayed[flip, 0] = (replayed[flip, 0] + 1) % 8
        replayed[flip, 0] = torch.where(replayed[flip, 0] == replayed[flip, 1], (replayed[flip, 0] + 1) % 8,
                                        replayed[flip, 0])
        valid = torch.rand(rows, generator=gen) < 0.9
        counter.observe(lid, native, replayed, valid, replayed=True)
    driver = summarize_layers(counter.as_metrics(PREFIX), PREFIX)
    return tag_phase(driver, PREFIX, "update")


@pytest.fixture(scope="module")
def passes() -> list[dict[str, float]]:
    return [_pass(1, 40), _pass(2, 25)]


def _expected(passes: list[dict[str, float]]) -> dict[str, float]:
    """The documented reduction: ``*_min`` the minimum over passes, everything else the mean over the
    passes that logged the key."""
    keys = {k for p in passes for k in p}
    out = {}
    for k in keys:
        vals = [p[k] for p in passes if k in p]
        out[k] = min(vals) if k.endswith("_min") else sum(vals) / len(vals)
    return out


def _close(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        assert math.isclose(float(got[k]), v, rel_tol=1e-6, abs_tol=1e-9), (k, got[k], v)


def test_compact_by_default(passes):
    p = passes[0]
    layer_keys = [k for k in p if "/agreement/layer_" in k and not k.endswith("layer_min")]
    assert len(layer_keys) == WORST_LAYERS and len(p) <= 10, sorted(p)
    worst = sorted(float(p[k]) for k in layer_keys)
    assert p[f"{PREFIX}update/agreement/layer_min"] == worst[0]
    opt_in = summarize_layers(AgreementCounter(LAYERS).as_metrics(PREFIX) | {f"{PREFIX}agreement/layer_{i}": 1.0
                                                                                for i in LAYERS}, PREFIX, per_layer=True)
    assert sum("/agreement/layer_" in k for k in opt_in) == len(LAYERS) + 1


def test_verl_reduction(passes):
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import append_to_dict

    # the engine returns {key: [value]} per mini-batch (append-list); verl's worker flattens the
    # micro-batch lists and appends mini-batch after mini-batch; the trainer reduces
    step: dict[str, list] = {}
    for p in passes:
        append_to_dict(step, {k: v for k, v in p.items()})
    _close(reduce_metrics(step), _expected(passes))


def test_skyrl_reduction(passes):
    from r3bridge.adapters.skyrl._compat import import_skyrl

    reduce_metrics = import_skyrl("skyrl.backends.skyrl_train.workers.worker_utils").reduce_metrics
    step: dict[str, list] = {}
    for p in passes:
        for k, v in p.items():
            step.setdefault(k, []).append(v)
    _close(reduce_metrics(step), _expected(passes))


def test_areal_reduction_and_names(passes):
    from r3bridge.adapters.areal._compat import import_areal
    from r3bridge.adapters.areal.hooks import log_areal_metrics

    tracker = import_areal("areal.utils.stats_tracker")
    tracker.DEFAULT_TRACKER.export()                    # start empty
    with tracker.scope("ppo_actor"), tracker.scope("update"):     # the PPO actor's scopes
        for p in passes:
            log_areal_metrics(tracker, p)
    got = tracker.DEFAULT_TRACKER.export()
    # AReaL adds its own "<key>__count" beside each scalar and min stat; the names are r3bridge's
    ours = {k: v for k, v in got.items() if not k.endswith("__count")}
    assert not any(k.startswith("ppo_actor/") for k in got), sorted(got)
    _close(ours, _expected(passes))
    assert all(got[f"{k}__count"] == sum(k in p for p in passes) for k in ours)


def test_areal_min_stats_on_the_engine_device(passes):
    """The MIN stats go on the engine's device: AReaL's ``export_stats`` all-reduces them over the
    data-parallel group, which NCCL refuses for host tensors (``meta`` stands in for the GPU)."""
    import torch

    from r3bridge.adapters.areal._compat import import_areal
    from r3bridge.adapters.areal.hooks import log_areal_metrics

    tracker = import_areal("areal.utils.stats_tracker")
    tracker.DEFAULT_TRACKER.export()                    # start empty
    try:
        log_areal_metrics(tracker, passes[0], device=torch.device("meta"))
        mins = {k: v for k, v in tracker.DEFAULT_TRACKER.stats.items() if k.endswith("_min") or k.endswith("_min__count")}
        assert mins and all(t.device.type == "meta" for v in mins.values() for t in v), mins
    finally:
        tracker.DEFAULT_TRACKER.stats.clear()           # meta tensors cannot be exported
        tracker.DEFAULT_TRACKER.denominators.clear()
        tracker.DEFAULT_TRACKER.reduce_types.clear()
