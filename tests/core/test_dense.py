"""``r3bridge.dense_routes`` / ``padded_routes``: a ReplayBatch back in a dense per-sample layout,
"no route" written explicitly (never the filler ids of invalid rows)."""
from __future__ import annotations

import pytest
import torch

from r3bridge import NO_ROUTE, ReplayBatch, dense_routes, padded_routes
from r3bridge.errors import CoverageError, RouteValueError


def _batch():
    # sample 0: rows 0-2, row 1 not routed (its filler ids 0, 1 look like a real top-2); sample 1 from token 2
    return ReplayBatch.from_ragged([torch.tensor([[[2, 3]], [[5, 6]], [[1, 7]]]), torch.tensor([[[4, 0]]])],
                                   num_experts=8, layer_ids=[1], valid=[[True, False, True], [True]],
                                   start_rows=[0, 2])


def test_dense_routes_mark_every_unrouted_token():
    rb = _batch()
    assert rb.sequence(0)[0][1].tolist() == [[0, 1]]           # the filler a naive write-back would copy
    per = dense_routes(rb, [4, 4])
    assert per[0][:, 0].tolist() == [[2, 3], [NO_ROUTE] * 2, [1, 7], [NO_ROUTE] * 2]
    assert per[1][:, 0].tolist() == [[NO_ROUTE] * 2, [NO_ROUTE] * 2, [4, 0], [NO_ROUTE] * 2]
    assert [p.shape[0] for p in dense_routes(rb)] == [3, 3]     # default: up to the last covered token
    sentinel = dense_routes(rb, no_route=255, dtype=torch.uint8)
    assert sentinel[0][1].tolist() == [[255, 255]] and sentinel[0].dtype == torch.uint8


def test_padded_routes_follow_the_mask():
    rb = _batch()
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])          # left- and right-padded rows
    out = padded_routes(rb, mask)
    assert out.shape == (2, 4, 1, 2)
    assert out[0, :, 0].tolist() == [[-1, -1], [2, 3], [-1, -1], [1, 7]]
    assert out[1, :, 0].tolist() == [[-1, -1], [-1, -1], [4, 0], [-1, -1]]
    back = ReplayBatch.from_padded(out, mask, num_experts=8, layer_ids=[1], valid=(out != NO_ROUTE).flatten(-2).any(-1))
    assert back.sequence(0)[1].tolist() == [True, False, True]


def test_bad_no_route_values_and_lengths_raise():
    rb = _batch()
    with pytest.raises(RouteValueError, match="no_route=0 is a real expert id"):
        dense_routes(rb, no_route=0)
    with pytest.raises(RouteValueError, match="cannot hold"):
        dense_routes(rb, no_route=-1, dtype=torch.uint8)
    with pytest.raises(CoverageError, match="sequence 0: routes cover tokens up to 3, past its 2 tokens"):
        dense_routes(rb, [2, 4])
    with pytest.raises(CoverageError, match="one row per sequence"):
        padded_routes(rb, torch.ones(3, 4))
