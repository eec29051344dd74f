"""r3bridge.metrics: formulas against hand-computed values (plain Python math), last-token
exclusion without wrap-around, order-insensitive route agreement, counter merge / all-reduce."""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import r3bridge
from r3bridge.metrics import (
    AgreementCounter,
    MetricsInputError,
    expert_load,
    logprob_mismatch,
    logprob_mismatch_packed,
    logprob_mismatch_sums,
    mismatch_from_sums,
    route_agreement,
    topk_sets_equal,
)

REPO = Path(__file__).resolve().parents[2]
P = "r3bridge/mismatch/"


def _expected(ds, taus=(2, 5)):
    """The documented formulas, in plain Python on a list of d values."""
    n = len(ds)
    out = {
        "abs_diff": sum(abs(d) for d in ds) / n,
        "sq_diff": sum(d * d for d in ds) / n,
        "k3_kl": sum(math.exp(d) - 1 - d for d in ds) / n,
    }
    for t in taus:
        out[f"F{t}"] = sum(1 for d in ds if abs(d) > math.log(t)) / n
    out["num_tokens"] = float(n)
    return out


def _check(got, ds, taus=(2, 5), prefix=P, rel=1e-9):
    exp = _expected(ds, taus)
    assert set(got) == {prefix + k for k in exp}
    for k, v in exp.items():
        assert got[prefix + k] == pytest.approx(v, rel=rel, abs=1e-15), k


# ------------------------------------------------------------------------------- log-prob mismatch
def test_mismatch_hand_computed_padded():
    # row 0: response tokens at 1..3 (3 is the last valid -> excluded)
    # row 1: response tokens at 0..1 (1 excluded), right padding
    train = torch.tensor([[-9.0, -1.0, -2.0, -3.0], [-0.5, -0.5, 0.0, 0.0]], dtype=torch.float64)
    roll = torch.tensor([[0.0, -1.8, -0.25, -7.0], [-0.4, -9.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    ds = [-1.0 - -1.8, -2.0 - -0.25, -0.5 - -0.4]          # 0.8, -1.75, -0.1
    got = logprob_mismatch(train, roll, mask)
    _check(got, ds)
    # by hand, so the expected values are not just the same code twice:
    assert got[P + "abs_diff"] == pytest.approx((0.8 + 1.75 + 0.1) / 3)
    assert got[P + "F2"] == pytest.approx(2 / 3)         # |0.8| and |-1.75| > ln 2 = 0.693
    assert got[P + "F5"] == pytest.approx(1 / 3)         # only |-1.75| > ln 5 = 1.609
    # without exclusion the last tokens count too
    ds_all = ds + [-3.0 - -7.0, -0.5 - -9.0]
    _check(logprob_mismatch(train, roll, mask, exclude_last=False), ds_all)


def test_k3_sign_convention():
    # d = log pi_train - log pi_rollout; k3 term = exp(d) - 1 - d (r = pi_train / pi_rollout)
    ln2 = math.log(2.0)
    m = torch.ones(1, 2, dtype=torch.bool)
    f64 = dict(dtype=torch.float64)
    up = logprob_mismatch(torch.tensor([[ln2, 0.0]], **f64), torch.zeros(1, 2, **f64), m)
    down = logprob_mismatch(torch.tensor([[-ln2, 0.0]], **f64), torch.zeros(1, 2, **f64), m)
    assert up[P + "k3_kl"] == pytest.approx(2 - 1 - ln2)        # 0.30685...
    assert down[P + "k3_kl"] == pytest.approx(0.5 - 1 + ln2)    # 0.19315...
    assert up[P + "F2"] == 0.0   # |d| = ln 2 is not > ln 2: strict


def test_k3_is_accurate_for_tiny_differences():
    tr = torch.tensor([[-1.0001, -2.0, 0.0]], dtype=torch.float32)
    ro = torch.tensor([[-1.0, -2.00002, 0.0]], dtype=torch.float32)
    m = torch.tensor([[True, True, True]])
    ds = [float(tr[0, 0]) - float(ro[0, 0]), float(tr[0, 1]) - float(ro[0, 1])]
    got = logprob_mismatch(tr, ro, m)
    exp = sum(math.expm1(d) - d for d in ds) / 2
    assert got[P + "k3_kl"] == pytest.approx(exp, rel=1e-9)
    assert got[P + "k3_kl"] > 0


def test_last_token_exclusion_no_wraparound():
    # Row 0 is fully valid; row 1 starts with a huge difference. torch.roll-style shifting would
    # drop row 1's first token or pull it into row 0; per-row masking drops only each row's
    # last valid token.
    B, T = 3, 5
    train = torch.zeros(B, T)
    roll = torch.zeros(B, T)
    train[0, T - 1] = 100.0    # row 0's last valid token: excluded
    train[1, 0] = 3.0          # row 1's first token: counted once
    train[2, 2] = 50.0         # row 2: left padded, last valid is 2 -> excluded
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2] = torch.tensor([False, False, True, False, False])  # single valid token -> nothing left
    mask[1, 4] = False
    got = logprob_mismatch(train, roll, mask)
    ds = [0.0] * (T - 1) + [3.0] + [0.0] * 2     # row 0: 4 tokens, row 1: tokens 0..2
    _check(got, ds)


def test_mask_with_holes_excludes_only_last_true():
    # multi-turn: response tokens, tool output (masked), response tokens
    train = torch.tensor([[1.0, 2.0, 0.0, 0.0, 4.0, 5.0, 0.0]])
    roll = torch.zeros(1, 7)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    _check(logprob_mismatch(train, roll, mask), [1.0, 2.0, 4.0])


def _reference_loop(train, roll, mask, exclude_last):
    ds = []
    for b in range(len(train)):
        idx = [t for t in range(len(train[b])) if mask[b][t]]
        if exclude_last and idx:
            idx = idx[:-1]
        ds += [float(train[b][t]) - float(roll[b][t]) for t in idx]
    return ds


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("exclude_last", [True, False])
def test_padded_and_packed_match_a_plain_loop(seed, exclude_last):
    rnd = random.Random(seed)
    B, T = rnd.randint(1, 6), rnd.randint(1, 9)
    train = [[rnd.gauss(-1, 1) for _ in range(T)] for _ in range(B)]
    roll = [[x + rnd.gauss(0, 0.8) for x in row] for row in train]
    mask = [[rnd.random() < 0.7 for _ in range(T)] for _ in range(B)]
    ds = _reference_loop(train, roll, mask, exclude_last)
    tr, ro = torch.tensor(train, dtype=torch.float64), torch.tensor(roll, dtype=torch.float64)
    m = torch.tensor(mask)
    got = logprob_mismatch(tr, ro, m, exclude_last=exclude_last)
    if ds:
        _check(got, ds)
    else:
        assert got[P + "num_tokens"] == 0.0 and got[P + "abs_diff"] == 0.0
    # packed: same rows concatenated, with 3 padding tokens at the end that never count
    cu = [0]
    for _ in range(B):
        cu.append(cu[-1] + T)
    flat_t = torch.cat([tr.reshape(-1), torch.full((3,), 99.0, dtype=torch.float64)])
    flat_r = torch.cat([ro.reshape(-1), torch.zeros(3, dtype=torch.float64)])
    flat_m = torch.cat([m.reshape(-1), torch.ones(3, dtype=torch.bool)])
    got_p = logprob_mismatch_packed(flat_t, flat_r, torch.tensor(cu), flat_m, exclude_last=exclude_last)
    assert got_p == pytest.approx(got)


def test_packed_ragged_sequences():
    # three sequences of lengths 3, 0, 2 then padding; no mask: every token inside a sequence
    tr = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0, 7.0]])   # [1, T] THD shape accepted
    ro = torch.zeros(1, 6)
    cu = [0, 3, 3, 5]
    _check(logprob_mismatch_packed(tr, ro, cu), [1.0, 2.0, 10.0])
    _check(logprob_mismatch_packed(tr, ro, cu, exclude_last=False), [1.0, 2.0, 3.0, 10.0, 20.0])


def test_sums_add_up_across_ranks():
    g = torch.Generator().manual_seed(0)
    tr = torch.randn(6, 7, generator=g)
    ro = tr + 0.3 * torch.randn(6, 7, generator=g)
    m = torch.rand(6, 7, generator=g) > 0.3
    whole = logprob_mismatch(tr, ro, m)
    s = logprob_mismatch_sums(tr[:2], ro[:2], m[:2]) + logprob_mismatch_sums(tr[2:], ro[2:], m[2:])
    assert s.dtype == torch.float64
    assert mismatch_from_sums(s) == pytest.approx(whole, rel=1e-12)


def test_custom_taus_and_prefix():
    got = logprob_mismatch(torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                           taus=(1.5, 3), prefix="x/")
    _check(got, [0.5], taus=(1.5, 3), prefix="x/mismatch/")
    assert "x/mismatch/F1.5" in got and "x/mismatch/F3" in got


def test_mismatch_bad_inputs_raise():
    with pytest.raises(MetricsInputError):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(r3bridge.ReplayError):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(MetricsInputError):
        logprob_mismatch_packed(torch.zeros(4), torch.zeros(4), [0, 3, 2])
    with pytest.raises(MetricsInputError):
        logprob_mismatch_packed(torch.zeros(4), torch.zeros(4), [0, 5])
    with pytest.raises(MetricsInputError):
        logprob_mismatch(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), taus=(1.0,))


# ------------------------------------------------------------------------------- route agreement
def _rb(seqs, *, E=8, layer_ids=(0, 1), start_rows=None, valid=None, route_kind="rollout", engine="ragged"):
    return r3bridge.ReplayBatch.from_ragged([torch.tensor(s) for s in seqs], num_experts=E,
                                            layer_ids=list(layer_ids), start_rows=start_rows,
                                            valid=valid, route_kind=route_kind, engine=engine)


def test_topk_sets_equal_is_order_insensitive():
    a = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 1, 2]], dtype=torch.uint8)
    b = torch.tensor([[3, 1, 2], [6, 5, 7], [2, 0, 1]], dtype=torch.int64)
    assert topk_sets_equal(a, b).tolist() == [True, False, True]


def test_route_agreement_hand_computed():
    # 2 sequences, layers (0, 1), K = 2. Differences (set-wise), marked *:
    #   seq 0 row 0: L0 [1,2] vs [2,1] equal (order),  L1 [3,4] vs [3,5] *
    #   seq 0 row 1: L0 [0,7] vs [0,7],                L1 [5,6] vs [6,5]
    #   seq 1 row 0: L0 [1,3] vs [1,4] *,              L1 [2,0] vs [1,0] *
    a = _rb([[[[1, 2], [3, 4]], [[0, 7], [5, 6]]], [[[1, 3], [2, 0]]]], engine="vllm")
    b = _rb([[[[2, 1], [3, 5]], [[0, 7], [6, 5]]], [[[1, 4], [1, 0]]]], route_kind="recorded", engine=None)
    rep = route_agreement(a, b)
    assert rep.layer_ids == (0, 1)
    assert rep.agree == (2, 1)
    assert rep.rows_compared == 3
    assert rep.per_layer == {0: pytest.approx(2 / 3), 1: pytest.approx(1 / 3)}
    assert rep.mean == pytest.approx(3 / 6)
    assert rep.rows_differing_any_layer == 2        # seq 0 row 0 and seq 1 row 0
    assert rep.tokens_differing_any_layer == pytest.approx(2 / 3)
    m = rep.as_metrics("p/")
    assert m == {"p/agreement/mean": pytest.approx(0.5), "p/agreement/layer_0": pytest.approx(2 / 3),
                 "p/agreement/layer_1": pytest.approx(1 / 3),
                 "p/agreement/tokens_differing_any_layer": pytest.approx(2 / 3),
                 "p/agreement/tokens_compared": 3.0}
    # symmetric in the counts
    assert route_agreement(b, a).agree == rep.agree


def test_route_agreement_permuted_k_is_full_agreement():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.stack([torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(3)])
                         for _ in range(n)]) for n in (5, 9, 1)]
    a = r3bridge.ReplayBatch.from_ragged(seqs, num_experts=16, layer_ids=[2, 4, 6])
    perm = [s[..., torch.randperm(4, generator=g)] for s in seqs]
    b = r3bridge.ReplayBatch.from_ragged(perm, num_experts=16, layer_ids=[2, 4, 6])
    rep = route_agreement(a, b)
    assert rep.mean == 1.0 and rep.tokens_differing_any_layer == 0.0 and rep.rows_compared == 15


def test_route_agreement_matches_rows_by_token_position():
    # a covers tokens 2..4 (e.g. rollout from the prompt offset); b covers 0..5 (recorded).
    rows_b = [[[i % 8, (i + 1) % 8]] for i in range(6)]            # token t -> experts {t, t+1}
    rows_a = [rows_b[t] for t in (2, 3, 4)]
    a = _rb([rows_a], layer_ids=(3,), start_rows=[2])
    b = _rb([rows_b], layer_ids=(3,), start_rows=[0])
    rep = route_agreement(a, b)
    assert (rep.rows_overlap, rep.rows_compared, rep.mean) == (3, 3, 1.0)
    # the same routes matched by row index instead of token position would disagree
    a0 = _rb([rows_a], layer_ids=(3,), start_rows=[0])
    assert route_agreement(a0, b).mean == 0.0


def test_route_agreement_skips_invalid_rows_and_reports_layers():
    a = _rb([[[[1, 2], [3, 4]], [[1, 2], [3, 4]], [[1, 2], [3, 4]]]], layer_ids=(0, 1),
            valid=[[True, False, True]])
    # b stores the layers in the other order: matched by id, not by position
    b = _rb([[[[3, 4], [2, 1]], [[5, 6], [0, 1]], [[0, 1], [2, 3]]]], layer_ids=(1, 0),
            valid=[[True, True, False]])
    rep = route_agreement(a, b)
    assert (rep.rows_compared, rep.rows_valid_only_reference, rep.rows_valid_only_other) == (1, 1, 1)
    assert rep.mean == 1.0
    with pytest.raises(r3bridge.RouteShapeError):        # num_experts differ
        route_agreement(a, _rb([[[[3, 4], [2, 1]]] * 3], E=10, layer_ids=(1, 0)))
    c = _rb([[[[1, 2], [3, 4], [5, 6]]]], layer_ids=(1, 5, 7))
    a1 = _rb([[[[1, 2], [3, 4]]]], layer_ids=(0, 1))
    rep = route_agreement(a1, c)
    assert rep.layer_ids == (1,) and rep.layers_only_reference == (0,) and rep.layers_only_other == (5, 7)
    assert rep.agree == (0,)     # layer 1: [3, 4] vs [1, 2]


def test_route_agreement_nothing_compared_is_nan():
    a = _rb([[[[1, 2], [3, 4]]]], valid=[[False]])
    rep = route_agreement(a, a)
    assert rep.rows_compared == 0 and math.isnan(rep.mean)
    assert "r3bridge/agreement/layer_0" not in rep.as_metrics()


def test_route_agreement_refuses_unrelated_batches():
    a = _rb([[[[1, 2], [3, 4]]]])
    with pytest.raises(r3bridge.CoverageError):
        route_agreement(a, _rb([[[[1, 2], [3, 4]]], [[[1, 2], [3, 4]]]]))
    with pytest.raises(r3bridge.RouteShapeError):
        route_agreement(a, _rb([[[[1], [3]]]]))
    with pytest.raises(r3bridge.LayerMappingError):
        route_agreement(a, _rb([[[[1, 2], [3, 4]]]], layer_ids=(5, 6)))


def test_expert_load_counts_valid_rows_only():
    a = _rb([[[[1, 2], [3, 4]], [[1, 5], [3, 0]], [[6, 7], [6, 7]]]], valid=[[True, True, False]])
    load = expert_load(a)
    assert load.shape == (2, 8)
    assert load[0].tolist() == [0, 2, 1, 0, 0, 1, 0, 0]
    assert load[1].tolist() == [1, 0, 0, 2, 1, 0, 0, 0]


# ------------------------------------------------------------------------------- AgreementCounter
def test_counter_add_and_metrics():
    c = AgreementCounter([1, 3])
    c.add(1, agree=torch.tensor(3), compared=4, replayed=4, native=1)
    c.add(3, agree=2, compared=torch.tensor(4), replayed=torch.tensor(4), native=torch.tensor(1))
    c.add(1, agree=1, compared=1, replayed=1)
    m = c.as_metrics("p/")
    assert m["p/agreement/layer_1"] == pytest.approx(4 / 5)
    assert m["p/agreement/layer_3"] == pytest.approx(2 / 4)
    assert m["p/agreement/mean"] == pytest.approx(6 / 9)
    assert m["p/agreement/pairs_compared"] == 9.0
    assert m["p/coverage"] == pytest.approx(9 / 11)
    assert (m["p/replayed_pairs"], m["p/native_pairs"]) == (9.0, 2.0)
    with pytest.raises(r3bridge.LayerMappingError):
        c.add(2, agree=1)


def test_counter_observe():
    native = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]])
    replay = torch.tensor([[2, 1], [3, 5], [5, 6], [7, 1]], dtype=torch.uint8)
    valid = torch.tensor([True, True, True, False])
    c = AgreementCounter(4)
    c.observe(2, native, replay, valid)                 # R2/R3: invalid row routed natively
    c.observe(3, native, replay, replayed=False)        # replay off: agreement only
    t = c.totals()
    assert t["agree"] == [0, 0, 2, 2]       # rows 0 ({1,2}) and 2 ({5,6}) agree
    assert t["compared"] == [0, 0, 3, 4]
    assert t["replayed"] == [0, 0, 3, 0]
    assert t["native"] == [0, 0, 1, 4]
    m = c.as_metrics()
    assert "r3bridge/agreement/layer_0" not in m
    assert m["r3bridge/coverage"] == pytest.approx(3 / 8)


def test_counter_merge_and_tensor_round_trip():
    a, b = AgreementCounter([0, 2, 4]), AgreementCounter([0, 2, 4])
    a.add(0, agree=5, compared=6, replayed=6, native=0)
    b.add(0, agree=1, compared=2, replayed=2, native=3)
    b.add(4, agree=7, compared=7, replayed=7)
    t = a.to_tensor() + b.to_tensor()         # what all_reduce(SUM) computes
    assert t.dtype == torch.int64 and t.shape == (3, 4)
    r = AgreementCounter.from_tensor(t, [0, 2, 4])
    a.merge(b)
    assert torch.equal(r.counts, a.counts)
    assert r.as_metrics() == pytest.approx(a.as_metrics(), nan_ok=True)
    snap = a.to_tensor()
    a.add(2, agree=1)
    assert not torch.equal(snap, a.counts)    # to_tensor is a copy
    with pytest.raises(r3bridge.LayerMappingError):
        a.merge(AgreementCounter([0, 2]))
    with pytest.raises(r3bridge.ReplayError):
        AgreementCounter.from_tensor(torch.zeros(2, 4), [0, 2, 4])
    a.reset()
    assert int(a.counts.sum()) == 0 and math.isnan(a.as_metrics()["r3bridge/agreement/mean"])


def test_counter_all_reduce_over_two_gloo_ranks(tmp_path):
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist, torch.multiprocessing as mp
        from r3bridge.metrics import AgreementCounter

        def work(rank):
            dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
            c = AgreementCounter([1, 3])
            c.add(1 if rank == 0 else 3, agree=rank + 1, compared=3, replayed=3, native=rank)
            c.all_reduce()
            assert c.counts.tolist() == [[1, 3, 3, 0], [2, 3, 3, 1]], c.counts.tolist()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.start_processes(work, nprocs=2, start_method="fork")
            print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


def test_counter_all_reduce_without_process_group_is_noop():
    c = AgreementCounter(2)
    c.add(0, agree=1, compared=1)
    assert c.all_reduce() is c and c.counts[0].tolist() == [1, 1, 0, 0]

