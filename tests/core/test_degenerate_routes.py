"""Degenerate routes (issue 38 item 1, vLLM #54730): inside the rows an engine returned, a row whose
ids repeat is refused by default or routed natively and counted, never read as "no route"; rows
past what the engine captured, and padding samples, are "no route". The one reader decides it
(docs/architecture.md, "One reader"), the same way for every transport."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from r3bridge import ParallelLayout
from r3bridge.errors import DegenerateRouteError, RouteValueError
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.read import read_targets
from testlab.engine_report import engine_row_report

E, K, LAYERS = 8, 2, 3           # layer 0 dense (zero columns), layers 1, 2 MoE
MOE = [1, 2]


def _engine(rows: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    a = np.stack([g.permutation(E)[:K] for _ in range(rows * LAYERS)]).reshape(rows, LAYERS, K).astype(np.int16)
    a[:, 0] = 0
    return a


def _zero_transport(per_sample: list[np.ndarray], lens: list[int]) -> HandedRoutes:
    """verl's layout: one row per token, rows past what the engine returned zero."""
    values = np.zeros((sum(lens), LAYERS, K), dtype=np.int16)
    off = 0
    for a, n in zip(per_sample, lens):
        values[off:off + len(a)] = a
        off += n
    return HandedRoutes.from_packed(torch.from_numpy(values), lens, num_experts=E, layer_ids=MOE, columns=MOE,
                                    no_route="zero", names=[f"sample {i}" for i in range(len(lens))])


def _read(handed: HandedRoutes, lens: list[int], **kw):
    lay = ParallelLayout(LAYERS, [0, 1, 1])
    rows = RankRows.build(lay, lens, tp_rank=0, cp_rank=0).cover(handed)
    counts: list = []
    t = read_targets(handed, rows, MOE, counts=counts, **kw)
    return t, counts[0]


def test_tails_and_padding_samples_are_no_route_and_inner_zero_rows_are_degenerate():
    lens = [6, 5, 4]
    engine = [_engine(5, 0), _engine(2, 1), np.zeros((0, LAYERS, K), np.int16)]   # tail of 2; a padding sample
    t, counts = _read(_zero_transport(engine, lens), lens)
    assert t.valid.tolist() == [True] * 5 + [False] + [True] * 2 + [False] * 3 + [False] * 4
    assert counts.replayed.tolist() == [5 * 2, 2 * 2, 0] and counts.degenerate.tolist() == [0, 0, 0]
    # the #54730 signature inside the captured rows: refused by default, naming sample, row, layer
    broken = [e.copy() for e in engine]
    broken[0][2, MOE] = 0
    with pytest.raises(DegenerateRouteError, match=r"^sample 0, row 2 \(token 2\), layer 1: duplicate expert ids \[0, 0\]"):
        _read(_zero_transport(broken, lens), lens)
    assert issubclass(DegenerateRouteError, RouteValueError)
    # routed natively when asked, and counted apart from "no route"
    t, counts = _read(_zero_transport(broken, lens), lens, degenerate="native")
    assert t.valid.tolist()[:6] == [True, True, False, True, True, False]
    assert counts.degenerate.tolist() == [2, 0, 0] and counts.replayed.tolist() == [4 * 2, 2 * 2, 0]


def test_whole_batch_form_agrees_with_the_rank_read():
    lens = [6, 5]
    engine = [_engine(5, 3), _engine(3, 4)]
    batch = _zero_transport(engine, lens).to_batch()
    assert batch.rows_per_seq == [5, 4]                     # the final row without a route dropped
    assert batch.valid.tolist() == [True] * 5 + [True] * 3 + [False]
    assert torch.equal(batch.routes[:5], torch.from_numpy(engine[0][:, MOE]).to(torch.uint8))
    broken = [engine[0].copy(), engine[1]]
    broken[0][1, 2] = [3, 3]
    with pytest.raises(DegenerateRouteError, match="sample 0, row 1 \\(token 1\\), layer 2"):
        _zero_transport(broken, lens).to_batch()
    native = _zero_transport(broken, lens).to_batch(degenerate="native")
    assert native.valid.tolist()[:5] == [True, False, True, True, True]


def test_engine_row_report_counts_and_refuses_the_54730_signature():
    good, bad = _engine(7, 5), _engine(6, 6)
    bad[2:4, MOE] = 0                                       # every MoE id of two rows: expert 0
    report = engine_row_report([good, bad], num_experts=E, moe_layer_ids=MOE)
    assert report.rows == [7, 6] and report.degenerate_rows == [0, 2] and report.first == (1, 2, 1)
    with pytest.raises(DegenerateRouteError, match=r"sequence 1, row 2 \(token 2\), layer 1"):
        engine_row_report([good, bad], num_experts=E, moe_layer_ids=MOE, refuse=True)
    # the payload transports vLLM uses read the same (JSON nested lists)
    assert engine_row_report([bad.tolist()], num_experts=E, moe_layer_ids=MOE).degenerate_rows == [2]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_device_check_equals_the_host_network(dtype):
    """The check the reader runs where the targets go (a sort on the router's device) finds what
    the host's sorting network finds, (row, layer) by (row, layer); run here on CPU tensors."""
    from r3bridge.engines.route_checks import _any_fault, _faults, _faults_torch

    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=g)[:K + 1] for _ in range(3 * 50)]).view(3, 50, K + 1).to(dtype)
    ids[0, 4, 1] = ids[0, 4, 0]                                   # a repeat
    ids[2, 9] = 0                                                 # the #54730 row
    ids[1, 20, 2] = E + 1 if dtype == torch.int16 else E          # out of range
    host, dev = _faults(ids, E), _faults_torch(ids, E)
    assert np.array_equal(host[0], dev[0]) and np.array_equal(host[1], dev[1])
    assert host[1][4, 0] and host[1][9, 2] and host[0][20, 1] and host[1].sum() == 2 and host[0].sum() == 1
    covered = np.ones(50, dtype=bool)
    assert _any_fault(ids, covered, E)
    covered[[4, 9, 20]] = False
    assert not _any_fault(ids, covered, E)
