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


def _weight_sync_job(ctx, dense_first: bool) -> dict:
    """One rank: the trainer's weights in HF names through the host (the default) and kept where the
    parameters are (``on_device``, the evidence run's per-step sync on one GPU)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from r3bridge.demo.hf_to_mcore import hf_to_mcore, mcore_to_hf, spec_from_hf
    from r3bridge.demo.warmstart import EvidenceModelShape
    from r3bridge.testing.harness.models import build_model_chunks, gather_full_state, load_reference_state

    cfg = EvidenceModelShape(layers=2, experts=8, topk=2, dense_first=dense_first).hf_config()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).state_dict()
    chunks = build_model_chunks(spec_from_hf(cfg), ctx)
    load_reference_state(chunks, hf_to_mcore(ref, cfg), ctx)
    with torch.no_grad():       # a step of training: the sync must carry the trainer's values
        for c in chunks:
            for p in c.parameters():
                p.add_(0.5)
    via_host = mcore_to_hf(gather_full_state(chunks, ctx), cfg, ref)
    on_device = mcore_to_hf(gather_full_state(chunks, ctx, on_device=True), cfg, ref)
    try:
        gather_full_state(chunks, dataclasses.replace(ctx, world_size=2), on_device=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {
        "order": list(on_device) == list(ref) == list(via_host),
        "same": [k for k in ref if not torch.equal(via_host[k], on_device[k])],
        "trained": [k for k in ref if not torch.equal(on_device[k], ref[k] + 0.5)],
        "shared": [k for k in ref if on_device[k].data_ptr() == ref[k].data_ptr()],
        "refused": refused,
    }


@pytest.mark.parametrize("dense_first", [False, True])
def test_weight_sync_kept_on_device_gives_the_host_paths_weights(dense_first):
    """The same values either way (the device path does the same arithmetic where the parameters
    live; only a GPU shows the difference, in the evidence run's ``timing_s/update_weights``), every
    HF tensor from the trainer and none aliasing the reference, in the reference's order."""
    from r3bridge.testing.harness.dist import spawn

    got = spawn(_weight_sync_job, world_size=1, args=(dense_first,))[0]
    assert got["order"]
    assert got["same"] == [] and got["trained"] == [] and got["shared"] == []
    assert "for one rank; this run has 2" in got["refused"]
