"""The CPU-testable parts of scripts/gpu/mbridge_autobridge.py (the GPU run itself needs
megatron-bridge 0.6.2 and Transformer Engine: docs/gpu.md, "Megatron-Bridge")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from testlab.gpu_scripts import gpu_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mb():
    return gpu_script("mbridge_autobridge")


@pytest.fixture(scope="module")
def hf(mb):
    from r3bridge.demo.hf_engine import build_hf_model

    cfg = mb.hf_config()
    return cfg, build_hf_model(cfg, seed=7, router_std=mb.ROUTER_STD)


def test_config_is_dense_first_qwen3_moe(mb, hf):
    cfg, model = hf
    assert cfg.model_type == "qwen3_moe" and cfg.num_hidden_layers == 4 and cfg.hidden_size == 256
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert mb.moe_layer_freq(cfg) == [0, 1, 1, 1]
    assert not hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.model.layers[1].mlp, "experts")


def test_dense_layer_tensors_are_the_hf_weights_under_te_names(mb, hf):
    cfg, model = hf
    s = model.state_dict()
    t = mb.dense_layer_tensors(s, cfg)
    assert sorted(t) == [
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    ]
    hp = "model.layers.0."
    assert torch.equal(
        t["decoder.layers.0.mlp.linear_fc1.weight"],
        torch.cat([s[hp + "mlp.gate_proj.weight"], s[hp + "mlp.up_proj.weight"]]),
    )
    assert torch.equal(t["decoder.layers.0.mlp.linear_fc2.weight"], s[hp + "mlp.down_proj.weight"])
    assert torch.equal(
        t["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"], s[hp + "post_attention_layernorm.weight"]
    )


def _named(shapes: dict[str, tuple]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


def test_nan_guard_names_what_nobody_loaded(mb):
    m = _named({"decoder.layers.0.mlp.linear_fc1.weight": (4, 2), "decoder.layers.0.mlp.linear_fc2.weight": (2, 2)})
    mb.fill_nan([m])
    assert mb.unloaded([m]) == [
        "chunk0.decoder.layers.0.mlp.linear_fc1.weight",
        "chunk0.decoder.layers.0.mlp.linear_fc2.weight",
    ]
    loaded = mb.load_named([m], {"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(4, 2)})
    assert loaded == ["decoder.layers.0.mlp.linear_fc1.weight"]
    assert mb.unloaded([m]) == ["chunk0.decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(KeyError, match="linear_fc3"):
        mb.load_named([m], {"decoder.layers.0.mlp.linear_fc3.weight": torch.ones(1)})
    with pytest.raises(ValueError, match=r"linear_fc2.weight: model shape \(2, 2\), HF gives \(3, 2\)"):
        mb.load_named([m], {"decoder.layers.0.mlp.linear_fc2.weight": torch.ones(3, 2)})


def test_router_init_is_decisive(mb, hf):
    """The top-2 is separated from the third expert by a clear margin on almost every row."""
    cfg, model = hf
    logits = []
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(
            lambda _m, _i, out: logits.append((out[0] if isinstance(out, tuple) else out).detach())
        )
        for i in (1, 2, 3)
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(1, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)))
    finally:
        for h in hooks:
            h.remove()
    assert len(logits) == 3
    top = torch.cat([x.reshape(-1, cfg.num_experts) for x in logits]).float().topk(3, -1).values
    gap = top[:, 1] - top[:, 2]
    assert float((gap < 1e-2).float().mean()) < 0.02, gap.quantile(torch.tensor([0.01, 0.5]))


def test_summary_passes_only_when_every_row_matched(mb):
    ok = dict(
        r3_rows=10,
        r2_rows=5,
        r3_mismatching_rows=0,
        r2_mismatching_rows=0,
        r2_logits_bit_equal=True,
        state_clean=True,
        errors=[],
        native_agree_rows=9,
        native_rows=10,
    )
    s = mb.summarize(ok)
    assert s["pass"] is True and s["native_agreement"] == 0.9
    for bad in (
        dict(r3_mismatching_rows=1),
        dict(r2_mismatching_rows=1),
        dict(r2_logits_bit_equal=False),
        dict(state_clean=False),
        dict(errors=["x"]),
        dict(r3_rows=0),
    ):
        assert mb.summarize({**ok, **bad})["pass"] is False, bad


def test_without_megatron_bridge_one_line_says_what_to_install(mb, tmp_path, capsys, monkeypatch):
    # absent here anyway (Python 3.11); None in sys.modules makes it absent wherever this runs
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    assert mb.main(["--out", str(tmp_path)]) == 1
    line = (tmp_path / "summary.json").read_text()
    got = json.loads(line)
    assert got["pass"] is False and "scripts/gpu/wheels/mbridge.txt" in got["error"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == got


def test_checkpoint_layout_is_what_the_bridge_maps(mb, hf, tmp_path):
    _, model = hf
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert mb.checkpoint_expert_layout(str(tmp_path)) == "per-expert"


def test_logprob_gap_is_zero_for_the_same_model_and_sees_a_change(mb, hf):
    from dataclasses import dataclass

    from r3bridge.demo.hf_to_mcore import packed_from_tokens

    cfg, model = hf
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 4, 7, 6, 3)]

    @dataclass
    class Result:
        logits: torch.Tensor

    batches, results = [], []
    with torch.no_grad():
        for grp in mb.GROUPS:
            b = packed_from_tokens([tokens[i] for i in grp], align=1)
            logits = torch.zeros(b.total, cfg.vocab_size)
            for j, i in enumerate(grp):
                off = int(b.cu_seqlens_padded[j])
                logits[off : off + len(tokens[i])] = model(input_ids=torch.tensor([tokens[i]])).logits[0]
            batches.append(b)
            results.append(Result(logits))
    same = mb.logprob_gap(model, tokens, batches, results)
    assert same["native_logprob_absdiff_max"] < 1e-5
    results[1].logits[int(batches[1].cu_seqlens_padded[1])] += 3.0 * torch.randn(cfg.vocab_size, generator=g)
    assert mb.logprob_gap(model, tokens, batches, results)["native_logprob_absdiff_max"] > 1e-2
