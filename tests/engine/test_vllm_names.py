"""The evidence run's weight sync into vLLM (r3bridge/demo/vllm_engine.py): vLLM cannot run here,
but the names its Qwen3-MoE loader maps are a Qwen3-MoE checkpoint's, and transformers writes
those itself (``save_pretrained`` turns its fused experts back into per-expert tensors). The
engine's conversion must give exactly that checkpoint, name for name and value for value."""
from __future__ import annotations

import pytest
import torch

from r3bridge.demo.vllm_engine import EngineError, _import_vllm, checkpoint_names
from r3bridge.demo.warmstart import EvidenceModelShape


@pytest.mark.parametrize("dense_first", [False, True])
def test_checkpoint_names_are_what_transformers_saves(tmp_path, dense_first):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(EvidenceModelShape(layers=2, dense_first=dense_first).hf_config())
    model.save_pretrained(tmp_path)
    ours = dict(checkpoint_names(model.state_dict()))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert sorted(ours) == sorted(saved.keys())
        for name in saved.keys():
            assert torch.equal(ours[name], saved.get_tensor(name)), name
    assert ("model.layers.0.mlp.experts.0.gate_proj.weight" in ours) is not dense_first


def test_missing_vllm_is_one_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)      # import raises ImportError
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")   # restored afterwards: the call sets it
    with pytest.raises(EngineError, match=r"needs vLLM .*vllm==0\.24\.0"):
        _import_vllm()
