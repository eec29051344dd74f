"""Silent engine corruptions named (issue 46 item 4, issue 50 item 4): 1-based expert ids, a layer
whose agreement collapses (a speculative draft writing one layer), prompt rows that disagree far
more than generated rows (prefill / decode disaggregation), KV-transfer settings under R3."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from r3bridge import ReplayBatch, RouteValueError
from r3bridge.engines.engine_settings import check_kv_transfer, kv_transfer_problem
from r3bridge.errors import ConfigError
from r3bridge.metrics.agreement import AgreementCounter, agreement_canaries, route_agreement


def _routes(rows: int, layers: int, k: int, experts: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    return np.stack([np.stack([g.permutation(experts)[:k] for _ in range(layers)]) for _ in range(rows)])


# ------------------------------------------------------------------------------ 1-based ids
@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int64])
def test_one_based_ids_reaching_num_experts_are_named(dtype):
    ids = (_routes(40, 3, 2, 8, 0) + 1).astype(dtype)            # [1, 8]: one id equals num_experts
    with pytest.raises(RouteValueError, match=r"out of range \[0, 8\).*no id is below 1 and one equals "
                                              r"num_experts=8: the ids look 1-based"):
        ReplayBatch.from_ragged([ids[:25], ids[25:]], num_experts=8, layer_ids=[0, 1, 2])


def test_an_id_past_the_range_without_the_1_based_pattern_gets_only_the_eplb_hint():
    ids = _routes(40, 3, 2, 8, 1)
    ids[5, 1] = [0, 9]                                            # 0 present: not 1-based
    with pytest.raises(RouteValueError) as e:
        ReplayBatch.from_ragged([ids], num_experts=8, layer_ids=[0, 1, 2])
    assert "1-based" not in str(e.value) and "pre-EPLB" in str(e.value)


def test_no_zero_in_a_large_batch_warns_and_a_small_one_does_not():
    one_based = _routes(400, 2, 2, 8, 2) + 1
    one_based[one_based == 8] = 7                                  # never reaches num_experts: passes the range
    one_based[:, :, 1] = np.where(one_based[:, :, 0] == one_based[:, :, 1], 1 + one_based[:, :, 0] % 6,
                                  one_based[:, :, 1])
    assert one_based.min() >= 1
    with pytest.warns(UserWarning, match=r"not one 0 .*are the ids 1-based\?"):
        ReplayBatch.from_ragged([one_based], num_experts=8, layer_ids=[0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReplayBatch.from_ragged([one_based[:10]], num_experts=8, layer_ids=[0, 1])     # 40 ids: too few to tell
        ReplayBatch.from_ragged([_routes(400, 2, 2, 8, 3)], num_experts=8, layer_ids=[0, 1])   # 0-based


# ------------------------------------------------------------------------------ agreement canaries
def _batch(routes: np.ndarray, lens: list[int]) -> ReplayBatch:
    offs = np.cumsum([0] + lens)
    return ReplayBatch.from_ragged([routes[a:b] for a, b in zip(offs[:-1], offs[1:])], num_experts=16,
                                   layer_ids=list(range(routes.shape[1])))


def test_a_collapsed_layer_warns_naming_speculative_decoding():
    ref = _routes(120, 4, 2, 16, 4)
    other = ref.copy()
    other[:, 0] = _routes(120, 1, 2, 16, 5)[:, 0]                 # layer 0 from another model (a draft)
    with pytest.warns(UserWarning, match=r"layer 0 collapsed to 0\.\d+ while the other layers hold 1\.000 .*"
                                         r"speculative-decoding draft"):
        report = route_agreement(_batch(ref, [60, 60]), _batch(other, [60, 60]))
    assert report.per_layer[0] < 0.25
    counter = AgreementCounter([0, 1, 2, 3])
    for lid in range(4):
        counter.observe(lid, torch.as_tensor(other[:, lid]), torch.as_tensor(ref[:, lid]))
    with pytest.warns(UserWarning, match=r"layer 0 collapsed"):
        counter.as_metrics()


def test_prompt_rows_far_worse_than_generated_rows_warn_naming_pd_disaggregation():
    ref = _routes(120, 3, 2, 16, 6)
    other = ref.copy()
    other[:40] = _routes(40, 3, 2, 16, 7)                         # sequence 0's 40 prompt rows: a stale buffer
    other[60:100] = _routes(40, 3, 2, 16, 8)                      # sequence 1's
    with pytest.warns(UserWarning, match=r"prompt rows differ .* prefill / decode disaggregation"):
        report = route_agreement(_batch(ref, [60, 60]), _batch(other, [60, 60]), prompt_lens=[40, 40])
    assert (report.prompt_rows_compared, report.generated_rows_compared) == (80, 40)
    assert report.generated_rows_differing == 0 and report.prompt_rows_differing >= 70


def test_noise_and_a_clean_run_raise_no_canary():
    ref = _routes(200, 4, 2, 16, 9)
    other = ref.copy()
    g = np.random.default_rng(10)
    noisy = g.random(200) < 0.05                                   # 5 % of rows re-routed on every layer
    other[noisy] = _routes(int(noisy.sum()), 4, 2, 16, 11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        route_agreement(_batch(ref, [100, 100]), _batch(other, [100, 100]), prompt_lens=[50, 50])
        route_agreement(_batch(ref, [100, 100]), _batch(ref, [100, 100]), prompt_lens=[50, 50])
    assert agreement_canaries({0: (2, 10), 1: (10, 10)}) == []     # too few rows to read


# ------------------------------------------------------------------------------ KV transfer
@pytest.mark.parametrize("engine, settings", [
    ("vllm", {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}),
    ("vllm", {"kv_connector": "MooncakeConnector"}),
    ("sglang", {"disaggregation_mode": "decode"}),
])
def test_kv_transfer_is_refused_under_r3(engine, settings):
    with pytest.raises(ConfigError, match=r"R3 with the rollout served through a KV connector .*llm-d-router #1473"):
        check_kv_transfer("R3", engine, settings)
    assert kv_transfer_problem("R2", engine, settings) is None     # R2 replays the trainer's own routes


def test_kv_transfer_off_passes():
    for settings in ({}, {"kv_transfer_config": None}, {"disaggregation_mode": "null"}, {"other": 1}):
        check_kv_transfer("R3", "sglang", settings)
