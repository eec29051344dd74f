"""Layer ids off by one (1-based keys read as 0-based ids) are named as such, not as their symptoms:
a bare ``KeyError``, "duplicate expert ids [0, 0]" or a layer a stage misses."""
from __future__ import annotations

import numpy as np
import pytest

import r3bridge
from r3bridge.batch.canonical import moe_layers_of
from r3bridge.engines.layer_ids import layers_from_mapping
from r3bridge.errors import LayerMappingError, RouteShapeError, RouteValueError

MOE = [0, 2, 3, 5]          # 6 layers, 1 and 4 dense


def _engine_routes(rows: int = 12, seed: int = 0) -> np.ndarray:
    """[rows, 6, 2] as vLLM / SGLang report them: every decoder layer, the dense ones zero."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, 6, 2), dtype=np.uint8)
    out[:, MOE] = np.argsort(-rng.random((rows, len(MOE), 8)), axis=-1)[..., :2]
    return out


def test_moe_ids_that_pick_dense_layers_are_named_off_by_one():
    routes = _engine_routes()
    assert moe_layers_of(routes, MOE, layer_dim=1, layer_axis="all_hidden").shape == (12, 4, 2)
    with pytest.raises(LayerMappingError, match=r"MoE layer ids \[1, 4\] pick layers whose rows are all zero .* layers "
                                                r"\[0, 2, 3, 5\] hold routes; the ids are one more than the model's"):
        moe_layers_of(routes, [1, 3, 4, 6][:3] + [5], layer_dim=1, layer_axis="all_hidden")
    batched = np.stack([np.zeros_like(routes), routes])            # a left-padded [B, S, L, K] field
    with pytest.raises(LayerMappingError, match="1-based"):
        moe_layers_of(batched, [1, 3, 4, 5], layer_dim=2, layer_axis="all_hidden")
    # built by hand from the dense columns: the duplicate-id error names the dense-layer cause too
    with pytest.raises(RouteValueError, match=r"duplicate expert ids \[0, 0\] .* or layer 1 is a dense layer: layer ids "
                                              r"are 0-based global"):
        r3bridge.ReplayBatch.from_ragged([routes[:, [1, 3, 4, 5]]], num_experts=8, layer_ids=[1, 3, 4, 5])


def test_routes_keyed_by_layer_stack_in_model_order_or_say_why_not():
    rng = np.random.default_rng(1)
    per_layer = {lid: np.argsort(-rng.random((5, 8)), axis=-1)[:, :2] for lid in MOE}
    stacked = layers_from_mapping(per_layer, MOE, topk=2)
    assert stacked.shape == (5, 4, 2) and (stacked[:, 2] == per_layer[3]).all()
    one_based = {lid + 1: v for lid, v in per_layer.items()}
    with pytest.raises(LayerMappingError, match=r"keyed by layers \[1, 3, 4, 6\], the model's MoE layers are "
                                                r"\[0, 2, 3, 5\] .*one more than the model's MoE layers .*1-based"):
        layers_from_mapping(one_based, MOE, field="sample 3")
    with pytest.raises(RouteShapeError, match="top-2 ids per layer, the model routes top-4"):
        layers_from_mapping(per_layer, MOE, topk=4)


def test_a_stage_missing_layers_of_one_based_ids_says_so():
    layout = r3bridge.ParallelLayout(6, [1, 0, 1, 1, 0, 1], pp=2)
    rb = r3bridge.ReplayBatch.from_ragged([_engine_routes()[:, MOE]], num_experts=8, layer_ids=[1, 3, 4, 6])
    with pytest.raises(LayerMappingError, match=r"needs MoE layers \[0, 2\], but the batch only has layers "
                                                r"\[1, 3, 4, 6\]; the ids are one more than .*1-based"):
        r3bridge.shard(rb, layout, [12], pp_rank=0)
