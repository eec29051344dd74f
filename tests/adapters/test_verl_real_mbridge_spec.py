"""The TE-free mbridge hook (testlab.mbridge_spec) on its own: scoped, restoring."""
from __future__ import annotations

import pytest
from mbridge.core import bridge as mb_bridge  # installed by `make install`

from testlab import mbridge_spec


def test_registry_swapped_inside_and_restored_after():
    before = dict(mb_bridge._MODEL_REGISTRY)
    with mbridge_spec.te_free_bridges(attention="identity") as swapped:
        assert "qwen3_moe" in swapped
        cls = mb_bridge._MODEL_REGISTRY["qwen3_moe"]
        assert cls is swapped["qwen3_moe"] and issubclass(cls, before["qwen3_moe"])
        assert cls.__mro__[1] is mbridge_spec.TEFreeBridgeMixin and cls.r3_attention == "identity"
    assert mb_bridge._MODEL_REGISTRY == before
    with pytest.raises(RuntimeError):
        with mbridge_spec.te_free_bridges():
            raise RuntimeError("a failed build")
    assert mb_bridge._MODEL_REGISTRY == before


def test_hf_dense_layer_rule():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=6, mlp_only_layers=[0, 3], decoder_sparse_step=2)
    # HF: MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert mbridge_spec.hf_moe_layer_freq(cfg) == [0, 1, 0, 0, 0, 1]
    assert mbridge_spec.hf_moe_layer_freq(type("C", (), {"num_hidden_layers": 2})()) is None
