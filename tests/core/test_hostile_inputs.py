"""Hostile inputs over the whole public API: every (API parameter) x (input class) cell.

Input classes, applied to each parameter's good value:

* ``big-endian``: the same integers in a non-native byte order (``astype('>i4')``); a valid
  integer array, so it must be converted exactly: the result equals the native call's;
* ``integral float``: the same integers as floats (``6.0``); converted exactly, except route ids,
  which must have an integer dtype;
* ``meta``: a meta-device tensor (shape, no values);
* ``fraction`` (``10.5``), ``nan``, ``inf``, ``string`` (``"6"``), ``bool`` (``True``): refused.

Refused means the parameter's own ``ReplayError`` subclass, with a message naming the parameter
(or "meta"): never a foreign exception (ValueError / RuntimeError from torch), never a silent
truncation. The table is ``CELLS`` below; each row is one public entry point and parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

from r3bridge import (
    CoverageError,
    LayerMappingError,
    LayoutError,
    ParallelLayout,
    PayloadError,
    ReplayBatch,
    ReplayError,
    RouteShapeError,
    shard,
    unshard,
)

from ._reference import random_routes

E, K, LIDS = 8, 2, [0, 1]
_rng = np.random.default_rng(3)
ROUTES = [random_routes(_rng, 5, 2, K, E), random_routes(_rng, 4, 2, K, E)]
LAYOUT = ParallelLayout(num_layers=2, moe_layer_freq=1)
LENS = [6, 5]


def _rb(**kw):
    return ReplayBatch.from_ragged(ROUTES, num_experts=E, layer_ids=LIDS, **kw)


def _targets():
    return {(0, 0, 0, 0): shard(_rb(), LAYOUT, LENS)}


def _sglang(**mi):
    base = {"prompt_tokens": 3, "completion_tokens": 3, "routed_experts": ROUTES[0].astype(np.int32)}
    return [{**base, **mi}]


@dataclass
class Param:
    api: str
    kind: str                      # routes | mask | list | scalar
    good: Any
    call: Callable[[Any], Any]
    error: type[ReplayError]
    names: str                     # fragment the message must contain (besides "meta" cells)


PADDED = np.stack([ROUTES[0][:4], ROUTES[1]])
MASK = np.ones((2, 4), dtype=bool)
MASK[0, 0] = False

PARAMS = [
    # routes
    Param("from_ragged", "routes", ROUTES, lambda v: ReplayBatch.from_ragged(v, num_experts=E, layer_ids=LIDS),
          RouteShapeError, "sequence 0"),
    Param("from_packed", "routes", np.concatenate(ROUTES),
          lambda v: ReplayBatch.from_packed(v, [5, 4], num_experts=E, layer_ids=LIDS), RouteShapeError, "routes"),
    Param("from_padded", "routes", PADDED,
          lambda v: ReplayBatch.from_padded(v, MASK, num_experts=E, layer_ids=LIDS), RouteShapeError, "padded"),
    Param("from_vllm", "routes", ROUTES, lambda v: ReplayBatch.from_vllm(v, num_experts=E),
          RouteShapeError, "sequence 0"),
    Param("from_sglang routed_experts", "routes", ROUTES[0].astype(np.int32),
          lambda v: ReplayBatch.from_sglang(_sglang(routed_experts=v), num_experts=E, num_layers=2, topk=K),
          (RouteShapeError, PayloadError), "routed_experts"),
    # masks
    Param("from_padded attention_mask", "mask", MASK,
          lambda v: ReplayBatch.from_padded(PADDED, v, num_experts=E, layer_ids=LIDS), CoverageError, "attention_mask"),
    Param("from_padded valid", "mask", MASK,
          lambda v: ReplayBatch.from_padded(PADDED, MASK, num_experts=E, layer_ids=LIDS, valid=v),
          CoverageError, "valid"),
    Param("from_ragged valid", "mask", [np.array([1, 0, 1, 1, 1], bool), np.ones(4, bool)],
          lambda v: _rb(valid=v), CoverageError, "valid"),
    Param("from_packed valid", "mask", np.array([1, 0, 1, 1, 1, 1, 1, 0, 1], bool),
          lambda v: ReplayBatch.from_packed(np.concatenate(ROUTES), [5, 4], num_experts=E, layer_ids=LIDS, valid=v),
          CoverageError, "valid"),
    # integer lists
    Param("from_ragged start_rows", "list", [1, 0], lambda v: _rb(start_rows=v), CoverageError, "start_rows"),
    Param("from_ragged layer_ids", "list", [2, 1],
          lambda v: ReplayBatch.from_ragged(ROUTES, num_experts=E, layer_ids=v), LayerMappingError, "layer_ids"),
    Param("from_ragged policy_versions", "list", [3, 2], lambda v: _rb(policy_versions=v),
          CoverageError, "policy_versions"),
    Param("from_packed rows_per_seq", "list", [5, 4],
          lambda v: ReplayBatch.from_packed(np.concatenate(ROUTES), v, num_experts=E, layer_ids=LIDS),
          CoverageError, "rows_per_seq"),
    Param("from_vllm moe_layer_ids", "list", [1, 0],
          lambda v: ReplayBatch.from_vllm(ROUTES, num_experts=E, moe_layer_ids=v), LayerMappingError, "moe_layer_ids"),
    Param("from_vllm start_rows", "list", [1, 0],
          lambda v: ReplayBatch.from_vllm(ROUTES, num_experts=E, start_rows=v), CoverageError, "start_rows"),
    Param("from_sglang moe_layer_ids", "list", [1],
          lambda v: ReplayBatch.from_sglang(_sglang(), num_experts=E, num_layers=2, topk=K, moe_layer_ids=v),
          LayerMappingError, "moe_layer_ids"),
    Param("from_sglang start_rows", "list", [1],
          lambda v: ReplayBatch.from_sglang(_sglang(completion_tokens=4), num_experts=E, num_layers=2, topk=K,
                                            start_rows=v), CoverageError, "start_rows"),
    Param("shard seq_lens", "list", LENS, lambda v: shard(_rb(), LAYOUT, v), CoverageError, "seq_lens"),
    Param("shard cu_seqlens_padded", "list", [0, 6, 11],
          lambda v: shard(_rb(), LAYOUT, LENS, cu_seqlens_padded=v), LayoutError, "cu_seqlens_padded"),
    Param("shard layer_ids", "list", [1], lambda v: shard(_rb(), LAYOUT, LENS, layer_ids=v),
          LayerMappingError, "layer_ids"),
    Param("unshard seq_lens", "list", LENS, lambda v: unshard(_targets(), LAYOUT, v, num_experts=E),
          CoverageError, "seq_lens"),
    Param("unshard start_rows", "list", [1, 0],
          lambda v: unshard(_targets(), LAYOUT, LENS, num_experts=E, start_rows=v), CoverageError, "start_rows"),
    Param("unshard rows_per_seq", "list", [5, 4],
          lambda v: unshard(_targets(), LAYOUT, LENS, num_experts=E, rows_per_seq=v), CoverageError, "rows_per_seq"),
    Param("select", "list", [1, 0], lambda v: _rb().select(v), CoverageError, "select"),
    Param("with_layers", "list", [1], lambda v: _rb().with_layers(v), LayerMappingError, "with_layers"),
    Param("ParallelLayout moe_layer_freq list", "list", [1, 0],
          lambda v: ParallelLayout(num_layers=2, moe_layer_freq=v), LayoutError, "moe_layer_freq"),
    # scalars
    *[Param(f"{api} num_experts", "scalar", E, call, RouteShapeError, "num_experts") for api, call in [
        ("from_ragged", lambda v: ReplayBatch.from_ragged(ROUTES, num_experts=v, layer_ids=LIDS)),
        ("from_packed", lambda v: ReplayBatch.from_packed(np.concatenate(ROUTES), [5, 4], num_experts=v,
                                                          layer_ids=LIDS)),
        ("from_padded", lambda v: ReplayBatch.from_padded(PADDED, MASK, num_experts=v, layer_ids=LIDS)),
        ("from_vllm", lambda v: ReplayBatch.from_vllm(ROUTES, num_experts=v)),
        ("from_sglang", lambda v: ReplayBatch.from_sglang(_sglang(), num_experts=v, num_layers=2, topk=K)),
        ("unshard", lambda v: unshard(_targets(), LAYOUT, LENS, num_experts=v)),
    ]],
    Param("from_sglang num_layers", "scalar", 2,
          lambda v: ReplayBatch.from_sglang(_sglang(), num_experts=E, num_layers=v, topk=K), RouteShapeError,
          "num_layers"),
    Param("from_sglang topk", "scalar", K,
          lambda v: ReplayBatch.from_sglang(_sglang(), num_experts=E, num_layers=2, topk=v), RouteShapeError, "topk"),
    Param("from_sglang prompt_tokens", "scalar", 3,
          lambda v: ReplayBatch.from_sglang(_sglang(prompt_tokens=v), num_experts=E, num_layers=2, topk=K),
          PayloadError, "prompt_tokens"),
    *[Param(f"shard {name}", "scalar", 0, (lambda name: lambda v: shard(_rb(), LAYOUT, LENS, **{name: v}))(name),  # noqa: B023 (bound by the outer lambda)
            LayoutError, name) for name in ("tp_rank", "cp_rank", "pp_rank", "vp_stage")],
    Param("shard seq_length (bshd)", "scalar", 6,
          lambda v: shard(_rb(), LAYOUT, LENS, format="bshd", seq_length=v), LayoutError, "seq_length"),
    *[Param(f"ParallelLayout {name}", "scalar", good,
            (lambda name: lambda v: ParallelLayout(**{"num_layers": 4, "moe_layer_freq": 1, "pp": 2, name: v}))(name),  # noqa: B023 (bound by the outer lambda)
            LayoutError, name)
      for name, good in (("num_layers", 4), ("moe_layer_freq", 2), ("tp", 2), ("cp", 2), ("pp", 2), ("vpp", 2),
                         ("ep", 2), ("num_layers_in_first_pipeline_stage", 2))],
    Param("ParallelLayout.moe_layers pp_rank", "scalar", 0, lambda v: LAYOUT.moe_layers(v), LayoutError, "pp_rank"),
]

CLASSES = ["big-endian", "integral float", "meta", "fraction", "nan", "inf", "string", "bool"]


def _hostile(cls: str, kind: str, good: Any) -> Any:
    """``good`` turned into input class ``cls`` (lists of arrays: every array)."""
    if isinstance(good, list) and good and isinstance(good[0], np.ndarray):
        return [_hostile(cls, kind, g) for g in good]
    if kind == "scalar":
        return {"big-endian": np.array(good, dtype=">i8"), "integral float": float(good),
                "meta": torch.tensor(good, device="meta"), "fraction": good + 0.5, "nan": math.nan,
                "inf": math.inf, "string": str(good), "bool": True}[cls]
    a = np.asarray(good)
    if cls == "big-endian":
        return a.astype(a.dtype.newbyteorder(">")) if a.dtype != bool else a.astype(">i2")
    if cls == "meta":
        return torch.from_numpy(a.astype(np.int64) if a.dtype != bool else a).to("meta")
    if cls == "string":
        return a.astype(str) if kind != "list" else [str(a.flat[0]), *a.tolist()[1:]]
    if cls == "bool":
        return a.astype(bool) if kind != "list" else [True, *a.tolist()[1:]]
    f = a.astype(np.float64)
    if cls != "integral float":
        f.flat[0] = {"fraction": float(a.flat[0]) + 0.5, "nan": math.nan, "inf": math.inf}[cls]
    return f if kind != "list" else f.tolist()


def _expect(cls: str, kind: str) -> str:
    """'same' (converted exactly: same result as the good value) or 'refused'."""
    if cls == "big-endian":
        return "same"
    if cls == "integral float":
        return "refused" if kind == "routes" else "same"
    if cls == "bool" and kind == "mask":
        return "same"                         # a bool mask is the native form
    return "refused"


def _same(a, b) -> bool:
    if isinstance(a, ReplayBatch):
        return a.equals(b) and a.policy_versions == b.policy_versions
    if hasattr(a, "indices"):
        return (a.layer_ids == b.layer_ids and torch.equal(a.valid, b.valid)
                and all(torch.equal(a.indices[k], b.indices[k]) for k in a.indices))
    return a == b


CELLS = [(p, c) for p in PARAMS for c in CLASSES
         if not (c == "bool" and p.kind == "routes")]      # bool routes: covered by "string"-like dtype refusal


@pytest.mark.parametrize("param,cls", CELLS, ids=[f"{p.api}|{c}" for p, c in CELLS])
def test_public_api_x_hostile_input(param: Param, cls: str):
    want = param.call(param.good)                  # the good value itself is accepted
    value = _hostile(cls, param.kind, param.good)
    if _expect(cls, param.kind) == "same":
        got = param.call(value)
        assert _same(got, want), f"{param.api}: {cls} input changed the result"
        return
    try:
        param.call(value)
    except ReplayError as e:
        assert isinstance(e, param.error), f"{param.api}: {cls} raised {type(e).__name__}: {e}"
        frag = "meta" if cls == "meta" else param.names
        assert frag in str(e), f"{param.api}: {cls}: {frag!r} not in {str(e)!r}"
    except Exception as e:          # noqa: BLE001 - the point: nothing but a ReplayError
        pytest.fail(f"{param.api}: {cls} input raised a foreign {type(e).__name__}: {e}")
    else:
        pytest.fail(f"{param.api}: {cls} input {value!r} was accepted")


def test_issue_examples():
    """The three reports of issue 15 part 2, verbatim."""
    big = [a.astype(">i4") for a in ROUTES]
    assert ReplayBatch.from_ragged(big, num_experts=E, layer_ids=LIDS).equals(_rb())
    assert ReplayBatch.from_vllm(big, num_experts=E).equals(ReplayBatch.from_vllm(ROUTES, num_experts=E))
    with pytest.raises(RouteShapeError, match="meta"):
        ReplayBatch.from_ragged([torch.from_numpy(a).to("meta") for a in ROUTES], num_experts=E, layer_ids=LIDS)
    one = ReplayBatch.from_ragged([ROUTES[0][:4]], num_experts=E, layer_ids=LIDS)
    shard(one, LAYOUT, [5])
    for bad in (10.5, 5.5, math.nan):
        with pytest.raises(CoverageError, match="seq_lens.*integral"):
            shard(one, LAYOUT, [bad])
    with pytest.raises(RouteShapeError, match="meta"):
        _rb().to("meta")
    with pytest.raises(LayoutError, match="meta"):
        shard(_rb(), LAYOUT, LENS, device="meta")
