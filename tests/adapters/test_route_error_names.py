"""Route errors name the sample as the framework knows it, and its token; a top-k mismatch is
refused at ingest naming the field and both values (verl, SkyRL, AReaL codecs; issue 22 item 5)."""
from __future__ import annotations

import pytest
import torch

from r3bridge.errors import CoverageError, RouteShapeError, RouteValueError

NUM_LAYERS, MOE, E, K = 3, [1, 2], 8, 2


def _routes(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n_tokens * NUM_LAYERS)])
    r = r.view(n_tokens, NUM_LAYERS, K).to(torch.int16)
    r[:, 0] = 0                       # the dense layer: zero rows, as verl carries them
    return r


# ------------------------------------------------------------------------------------ verl
def _verl_micro_batch(lens: list[int], batch_index: list[int] | None, *, bad: tuple[int, int] | None = None,
                      topk: int = K):
    from tensordict import TensorDict

    from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY

    per = [_routes(n, s) for s, n in enumerate(lens)]
    if topk != K:
        per = [torch.cat([p, p[..., :1] + 1], -1) % E for p in per]
    if bad is not None:
        s, t = bad
        per[s][t, 2] = torch.tensor([E + 3, 0][:per[s].shape[-1]], dtype=torch.int16)
    ids = torch.nested.nested_tensor([torch.arange(n) for n in lens], layout=torch.jagged)
    td = TensorDict({"input_ids": ids, ROUTES_KEY: torch.nested.nested_tensor(per, layout=torch.jagged)},
                    batch_size=[len(lens)])
    if batch_index is not None:
        td[SAMPLE_KEY] = torch.tensor(batch_index, dtype=torch.int64)
    return td


def _verl_ingest(td, topk: int | None = K):
    from r3bridge.adapters.verl.codec import handed_routes

    return handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                         num_hidden_layers=NUM_LAYERS, topk=topk).to_batch()


def test_verl_route_error_names_batch_index_and_token():
    # the engine's micro-batch holds samples 4 and 2 of its batch (verl re-orders them): the bad
    # route of the first one is "batch index 4", not "sequence 0"
    td = _verl_micro_batch([5, 6], [4, 2], bad=(0, 3))
    with pytest.raises(RouteValueError) as e:
        _verl_ingest(td)
    msg = str(e.value)
    assert msg.startswith("verl sample batch index 4: ") and "token 3" in msg and "layer 2" in msg, msg
    assert "sequence" not in msg
    td = _verl_micro_batch([5, 6], [4, 2], bad=(1, 1))
    with pytest.raises(RouteValueError, match=r"^verl sample batch index 2: .*token 1\b"):
        _verl_ingest(td)


def test_verl_without_batch_index_names_micro_batch_position():
    td = _verl_micro_batch([5, 6], None, bad=(1, 2))
    with pytest.raises(RouteValueError, match=r"^verl sample micro-batch position 1: .*token 2\b"):
        _verl_ingest(td)


def test_verl_invalid_rows_error_names_sample_and_token():
    from r3bridge.adapters.verl.codec import handed_routes

    td = _verl_micro_batch([5, 6], [7, 3])
    td["routed_experts"].values()[5 + 2] = 0      # sample 3's token 2: no route
    with pytest.raises(CoverageError, match=r"verl sample batch index 3: token 2 has no route"):
        handed_routes(td, moe_layer_ids=MOE, num_experts=E, route_kind="rollout",
                      num_hidden_layers=NUM_LAYERS).to_batch(invalid_rows="error")


def test_verl_topk_mismatch_refused_at_ingest_naming_both():
    td = _verl_micro_batch([5, 6], [0, 1], topk=K + 1)
    with pytest.raises(RouteShapeError, match=r"routed_experts carries 3 expert ids .* top-2"):
        _verl_ingest(td)
    _verl_ingest(_verl_micro_batch([5, 6], [0, 1]))     # the right width passes


def test_verl_engine_refuses_topk_mismatch_before_the_schedule():
    """``R3BridgeMegatronEngine`` checks the batch's width against the model in
    ``forward_backward_batch``, before verl's schedule runs (not at the first router)."""
    from types import SimpleNamespace

    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine
    from r3bridge.config import Phase
    from r3bridge.hf import ModelInfo
    from r3bridge.session.adapter_session import AdapterSession

    engine = SimpleNamespace(r3=AdapterSession("verl", where=None))
    engine.r3.model = ModelInfo(num_experts=E, topk=K)
    td = _verl_micro_batch([5, 6], None, topk=K + 1)
    with pytest.raises(RouteShapeError, match=r"the update batch: routed_experts carries 3 .* top-2"):
        R3BridgeMegatronEngine._r3_check_topk(engine, td, Phase.UPDATE)
    R3BridgeMegatronEngine._r3_check_topk(engine, _verl_micro_batch([5, 6], None), Phase.UPDATE)


# ------------------------------------------------------------------------------------ SkyRL
def _skyrl_batch(lens: list[int], *, bad: tuple[int, int] | None = None, topk: int = K) -> dict:
    S = max(lens)
    routes = torch.zeros(len(lens), S, NUM_LAYERS, topk, dtype=torch.int16)
    attn = torch.zeros(len(lens), S, dtype=torch.long)
    for i, n in enumerate(lens):
        r = _routes(n, i)
        if topk != K:
            r = torch.cat([r, (r[..., :1] + 1) % E], -1)
        routes[i, S - n:] = r                 # SkyRL left-pads
        attn[i, S - n:] = 1
    if bad is not None:
        s, t = bad
        routes[s, S - lens[s] + t, 2] = torch.tensor([E + 1, 1][:topk], dtype=torch.int16)
    return {"rollout_expert_indices": routes, "attention_mask": attn}


def test_skyrl_route_error_names_batch_row_and_token():
    from r3bridge.adapters.skyrl.codec import handed_routes

    with pytest.raises(RouteValueError, match=r"^SkyRL sample batch row 1: .*token 4\b.*layer 2"):
        handed_routes(_skyrl_batch([5, 7], bad=(1, 4)), num_experts=E, moe_layer_ids=MOE,
                      num_hidden_layers=NUM_LAYERS).to_batch()
    # a micro-batch of mini-batch rows 6 and 9
    with pytest.raises(RouteValueError, match=r"^SkyRL sample batch row 9: "):
        handed_routes(_skyrl_batch([5, 7], bad=(1, 4)), num_experts=E, moe_layer_ids=MOE,
                      num_hidden_layers=NUM_LAYERS, sample_ids=[6, 9]).to_batch()


def test_skyrl_topk_mismatch_refused_naming_both():
    from r3bridge.adapters.skyrl.codec import SkyRLCodec

    codec = SkyRLCodec(num_experts=E, moe_layer_ids=MOE, num_hidden_layers=NUM_LAYERS, topk=K)
    with pytest.raises(RouteShapeError, match=r"rollout_expert_indices carries 3 expert ids .* top-2"):
        codec.to_replay_batch(_skyrl_batch([5, 7], topk=K + 1))
    assert codec.to_replay_batch(_skyrl_batch([5, 7])).num_seqs == 2


# ------------------------------------------------------------------------------------ AReaL
def _areal_tensor(lens: list[int], *, bad: tuple[int, int] | None = None, topk: int = K) -> torch.Tensor:
    S = max(lens)
    t = torch.full((len(lens), len(MOE), topk, S), -1, dtype=torch.int16)
    for i, n in enumerate(lens):
        r = _routes(n, i)[:, MOE]
        if topk != K:
            r = torch.cat([r, (r[..., :1] + 1) % E], -1)
        t[i, :, :, :n] = r.permute(1, 2, 0)
    if bad is not None:
        s, tok = bad
        t[s, 1, :, tok] = torch.tensor([E + 2, 0][:topk], dtype=torch.int16)
    return t


def test_areal_route_error_names_batch_row_and_token():
    from r3bridge.adapters.areal.codec import handed_routes

    # a micro-batch of AReaL's trajectories 3 and 1 (token-balanced re-ordering)
    t = _areal_tensor([4, 6, 5, 7], bad=(3, 2))
    with pytest.raises(RouteValueError, match=r"^AReaL sample batch row 3: .*token 2\b.*layer 2"):
        handed_routes(t, [3, 1], [7, 6], num_experts=E, moe_layer_ids=MOE).to_batch()


def test_areal_topk_mismatch_refused_naming_both():
    from r3bridge.adapters.areal.codec import handed_routes

    with pytest.raises(RouteShapeError, match=r"routes carries 3 expert ids .* top-2"):
        handed_routes(_areal_tensor([4, 6], topk=K + 1), [0, 1], [4, 6], num_experts=E,
                      moe_layer_ids=MOE, topk=K).to_batch()
