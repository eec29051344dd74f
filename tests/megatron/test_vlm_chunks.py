"""VLM model chunks (issue 15 part 4): the decoder under ``.language_model.decoder``.

A CPU cell built from megatron-core 0.16.1's own multimodal class, ``LLaVAModel``: a MoE GPT
language model (2 MoE layers, 8 experts, top-2) and an InternViT-style vision tower that has a MoE
layer too, so "the vision tower's routers are never touched" is observable. The language decoder
is built twice, as Megatron-Bridge's Qwen3-VL does (verl #7340): the chunk's current decoder
replaces a first copy that stays alive. One rank, one spawn:

* the Replayer finds exactly the current language decoder's routers; the vision tower's and the
  first copy's carry no hook;
* R3 in a training step under megatron's schedule (forward + backward, an image in the batch):
  every language router call returns the rollout targets on rows that have one, the vision router
  routes natively, the first copy never runs;
* R2: the forward-only record pass returns exactly the language routers' own choices, per token
  of the image-expanded sequence;
* a chunk holding its own ``.decoder`` besides a different ``.language_model.decoder`` is refused.
"""
from __future__ import annotations

import copy
import functools
import traceback
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from replay_grid import make_routes

from r3bridge.testing.harness import dist
from r3bridge.testing.harness.cpu_shim import tensor_cuda_is_identity
from r3bridge.testing.harness.models import ModelSpec, make_config
from r3bridge.testing.harness.probe import topk_indices
from r3bridge.testing.harness.schedule import run_schedule

E, K, VOCAB = 8, 2, 128
TEXT, IMAGE_TOKEN = 20, -200        # 20 text positions, one of them the image; 28x28 px, 14 px patches
SEQ = TEXT - 1 + 4 + 1              # the image token becomes 4 patches + 1 class token: 24 decoder rows


def _mlp_submodules(spec):
    """The projector's ``MLPSubmodules``: a ``ModuleSpec``'s (0.16-0.17) or, from 0.18, the
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)``'s keyword."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def _build(ctx):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_mlp_module_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.transformer.transformer_block import TransformerBlock

    spec = ModelSpec(num_layers=2, num_moe_experts=E, moe_router_topk=K, vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    lang = make_config(spec, ctx)
    block = get_gpt_decoder_block_spec(lang, use_transformer_engine=False, vp_stage=None)
    vis = copy.deepcopy(lang)
    vis.num_layers = 1
    vis.vision_model_type = "internvit"          # the CLIP/SigLIP variants need TE norms
    proj = copy.deepcopy(vis)
    proj.num_moe_experts = None
    proj.ffn_hidden_size = lang.hidden_size
    with tensor_cuda_is_identity():
        model = LLaVAModel(lang, block, VOCAB, 64, vis,
                           get_gpt_decoder_block_spec(vis, use_transformer_engine=False, vp_stage=None), False,
                           proj, _mlp_submodules(get_mlp_module_spec(use_te=False)), img_h=28, img_w=28, patch_dim=14)
    from megatron.core.enums import ModelType
    model.model_type = ModelType.encoder_or_decoder   # what megatron's training get_model() sets
    first = model.language_model.decoder         # built twice: the first copy stays alive
    model.language_model.decoder = TransformerBlock(config=lang, spec=block, pre_process=True, post_process=True)
    return model, first


@dataclass(eq=False)       # micro-batches are found by identity
class VlmBatch:
    images: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    total: int = SEQ                             # run_schedule's p2p length (pp = 1 here)


def _batch(seed: int) -> VlmBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, TEXT), generator=g)
    ids[0, 3] = IMAGE_TOKEN
    labels = torch.randint(1, VOCAB, (1, TEXT), generator=g)
    return VlmBatch(torch.randn(1, 3, 28, 28, generator=g), ids, labels, torch.ones(1, TEXT))


def _forward_step(install):
    def forward_step(it, model):
        b = next(it)
        install(model, b)
        out, mask = model(b.images, b.input_ids, torch.arange(TEXT)[None], None, labels=b.labels,
                          loss_mask=b.loss_mask)
        return out, lambda o: ((o.float() * mask).sum() / mask.sum(), {"loss_sum": (o * mask).sum().detach(),
                                                                        "n_global": mask.sum()})
    return forward_step


def _routers(module):
    from megatron.core.transformer.moe.router import TopKRouter
    return [(n, m) for n, m in module.named_modules() if isinstance(m, TopKRouter)]


def _outcome(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "trace": traceback.format_exc()[-3000:]}


def scenarios(ctx) -> dict[str, Any]:
    from r3bridge.megatron import Replayer
    from r3bridge.megatron.hook import RouterHook

    model, first = _build(ctx)
    model.train()
    rep = Replayer([model])
    lang = _routers(model.language_model.decoder)
    vision = _routers(model.vision_model)
    orphan = _routers(first)
    calls: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_hook(
        (lambda key: lambda _m, _i, out: calls.setdefault(key, []).append(topk_indices(out[1].detach())))(f"{kind}:{n}"))
        for kind, group in (("lang", lang), ("vision", vision), ("orphan", orphan)) for n, m in group]
    hooked = {f"{kind}:{n}": isinstance(m.router_replay, RouterHook)
              for kind, group in (("lang", lang), ("vision", vision), ("orphan", orphan)) for n, m in group}

    batches = [_batch(1), _batch(2)]
    routes = [make_routes(rep.layout, [SEQ], E, K, 30 + i) for i in range(2)]
    with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
        run_schedule([model], batches, _forward_step(
            lambda m, b: st.install(m, routes[batches.index(b)], [SEQ])), forward_only=False)
    r3_calls = {k: [t.tolist() for t in v] for k, v in calls.items()}
    calls.clear()
    with rep.open_pass("record", forward_only=True) as st:
        run_schedule([model], batches, _forward_step(lambda m, b: st.install(m, None, [SEQ])), forward_only=True)
    recorded = st.recorded
    native = {k: [t.tolist() for t in v] for k, v in calls.items()}
    for h in handles:
        h.remove()
    rep.detach()

    # a chunk with its own .decoder besides a different .language_model.decoder
    model.decoder = first
    both = _outcome(lambda: Replayer([model]))
    return {
        "layers": rep.chunks[0].layer_ids, "hooked": hooked, "unmanaged": rep.unmanaged_calls,
        "targets": [[r.sequence(0)[0][:, j].to(torch.int64).sort(-1).values.tolist() for j in range(2)]
                    for r in routes],
        "r3_calls": r3_calls, "native": native, "metrics": st.metrics,
        "recorded": {"layers": list(recorded.layer_ids), "rows": recorded.rows_per_seq,
                     "routes": recorded.routes.to(torch.int64).sort(-1).values.tolist()},
        "both": both,
    }


@pytest.fixture(scope="module")
def out():
    return dist.spawn(scenarios, world_size=1, timeout=600)[0]


def test_only_the_current_language_decoder_is_hooked(out):
    assert out["layers"] == [0, 1]
    hooked = out["hooked"]
    assert sum(v for k, v in hooked.items() if k.startswith("lang:")) == 2
    assert any(k.startswith("vision:") for k in hooked) and any(k.startswith("orphan:") for k in hooked)
    assert not any(v for k, v in hooked.items() if not k.startswith("lang:")), hooked
    assert sum(hooked.values()) == 2                  # exactly one set of routers replays


def test_r3_training_step_replays_language_routers_only(out):
    lang = sorted(k for k in out["r3_calls"] if k.startswith("lang:"))
    assert len(lang) == 2
    for j, key in enumerate(lang):
        got = out["r3_calls"][key]
        assert len(got) == 2                          # one forward per micro-batch, no recompute
        for mb in range(2):
            want = out["targets"][mb][j]             # rows 0..SEQ-2: the last token has no route
            assert len(got[mb]) == SEQ and got[mb][:SEQ - 1] == want, f"{key}, micro-batch {mb}"
    vision = [k for k in out["r3_calls"] if k.startswith("vision:")]
    assert vision and all(len(c) == 5 for k in vision for c in out["r3_calls"][k])   # 4 patches + class
    assert not any(k.startswith("orphan:") for k in out["r3_calls"]), "the first decoder copy ran"
    assert out["unmanaged"] == 0


def test_r2_records_the_language_routers_own_choices(out):
    rec = out["recorded"]
    assert rec["layers"] == [0, 1] and rec["rows"] == [SEQ, SEQ]
    lang = sorted(k for k in out["native"] if k.startswith("lang:"))
    for mb in range(2):
        for j, key in enumerate(lang):
            got = [row[j] for row in rec["routes"][mb * SEQ:(mb + 1) * SEQ]]
            assert got == out["native"][key][mb], f"{key}, micro-batch {mb}"


def test_a_second_decoder_beside_the_language_model_is_refused(out):
    both = out["both"]
    assert not both["ok"] and "LayerMappingError" in both["mro"]
    assert "language_model.decoder" in both["message"] and "ambiguous" in both["message"]
