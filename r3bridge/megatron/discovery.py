"""Find the routers replay may touch: walk each model chunk's decoder, match by global layer id.

Never by position in megatron's process-global ``RouterReplay`` list: that list also holds the
routers of reference models, MTP blocks and decoders built twice (field notes 8.1), and is never pruned.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from r3bridge.errors import LayerMappingError
from r3bridge.parallel.layout import ParallelLayout


@dataclass
class ChunkRouters:
    """The decoder routers of one model chunk (= one virtual pipeline stage)."""

    chunk: torch.nn.Module          # the module the schedule calls (possibly DDP/Float16 wrapped)
    vp_stage: int
    routers: dict[int, torch.nn.Module] = field(default_factory=dict)   # global layer id -> router
    mtp_routers: list[torch.nn.Module] = field(default_factory=list)    # left native, reported only

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.routers)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``.decoder`` holds the routers replay may touch.

    DDP / Float16Module / FSDP wrappers keep the model in ``.module``. Multimodal models
    (megatron-core's ``LLaVAModel``, Qwen3-VL-style chunks) keep the text decoder in
    ``.language_model.decoder``: that one is used, never the vision tower's ``.decoder``. A chunk
    holding both its own ``.decoder`` and a different ``.language_model.decoder`` is refused:
    which of the two runs is not knowable here.
    """
    seen = 0
    while not _has_decoder(module) and hasattr(module, "module") and seen < 8:
        module = module.module
        seen += 1
    lm = getattr(module, "language_model", None)
    if lm is not None and hasattr(lm, "decoder"):
        own = getattr(module, "decoder", None)
        if own is not None and own is not lm.decoder:
            raise LayerMappingError(f"model chunk {type(module).__name__} has both .decoder and a different "
                                    f".language_model.decoder: which one runs is ambiguous")
        return lm
    if not hasattr(module, "decoder"):
        raise LayerMappingError(f"model chunk {type(module).__name__} has no .decoder: not a megatron GPT-style model")
    return module


def _has_decoder(module: torch.nn.Module) -> bool:
    lm = getattr(module, "language_model", None)
    return hasattr(module, "decoder") or (lm is not None and hasattr(lm, "decoder"))


def _router_of(layer: torch.nn.Module):
    from megatron.core.transformer.moe.router import TopKRouter

    mlp = getattr(layer, "mlp", None)
    router = getattr(mlp, "router", None)
    return router if isinstance(router, TopKRouter) else None


def find_routers(chunks: list[torch.nn.Module]) -> list[ChunkRouters]:
    """Decoder routers of each chunk, keyed by global 0-based layer id (``layer_number - 1``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for vp, chunk in enumerate(chunks):
        model = unwrap(chunk)
        found = ChunkRouters(chunk, vp)
        decoder = model.decoder
        for layer in getattr(decoder, "layers", []):
            router = _router_of(layer)
            if router is None:
                continue
            lid = int(layer.layer_number) - 1
            if router.layer_number is not None and int(router.layer_number) != lid + 1:
                raise LayerMappingError(f"chunk {vp}: router layer_number {router.layer_number} != its layer's {lid + 1}")
            if lid in found.routers:
                raise LayerMappingError(f"chunk {vp}: two decoder routers claim global layer {lid}")
            found.routers[lid] = router
        mtp = getattr(model, "mtp", None)
        if mtp is not None:
            # Every router anywhere in the MTP block, whatever holds it (0.16: one
            # ``transformer_layer`` per MTP layer; 0.17+: ``mtp_model_layer``, a layer or a stack).
            found.mtp_routers.extend(m for m in mtp.modules() if isinstance(m, TopKRouter))
        out.append(found)
    return out


# ---------------------------------------------------------------------------------- hybrid models
# megatron's HybridModel (0.18+; MambaModel in 0.16-0.17) numbers one layer per symbol of its
# pattern ("M" Mamba, "*" attention, "-" MLP, "E" MoE, ...; "|" splits pipeline stages, "/" starts
# the MTP part). A MoE symbol is a TransformerLayer with a MoELayer whose router has
# layer_number = its index in the pattern + 1. vLLM / SGLang report Nemotron-H-style models with
# one entry per pattern symbol (HF num_hidden_layers = len(pattern), routes written at the
# FusedMoE's layer index), so the pattern index is the engine layer id and config.moe_layer_freq
# (which the hybrid stack ignores) is not.

def hybrid_pattern(model: torch.nn.Module) -> str | None:
    """The decoder part of a hybrid model's layer pattern, one symbol per layer; None otherwise."""
    raw = getattr(model, "hybrid_layer_pattern", None) or getattr(model, "hybrid_override_pattern", None)
    if raw is None:
        return None
    return str(raw).split("/")[0].replace("|", "")


def layout_for(chunks: list[torch.nn.Module], config) -> ParallelLayout:
    """``ParallelLayout.from_megatron(config)``, with a hybrid model's MoE layers taken from its
    pattern. Pipeline splits are whatever megatron built: ``check_against_layout`` compares the
    routers each rank finds with the layout, so a split the layout cannot express is refused."""
    import dataclasses

    layout = ParallelLayout.from_megatron(config)
    patterns = {hybrid_pattern(unwrap(c)) for c in chunks}
    if patterns == {None}:
        return layout
    if len(patterns) != 1 or None in patterns:
        raise LayerMappingError(f"model chunks disagree on the hybrid layer pattern: {sorted(map(str, patterns))}")
    pattern = patterns.pop()
    assert pattern is not None
    if len(pattern) != layout.num_layers:
        raise LayerMappingError(f"hybrid pattern {pattern!r} has {len(pattern)} layers, config.num_layers is "
                                f"{layout.num_layers}")
    if "E" not in pattern:
        raise LayerMappingError(f"hybrid pattern {pattern!r} has no MoE ('E') layer: nothing to replay")
    return dataclasses.replace(layout, moe_layer_freq=tuple(int(c == "E") for c in pattern))


def check_against_layout(found: list[ChunkRouters], layout: ParallelLayout, pp_rank: int) -> None:
    """Routers found must be exactly the layout's MoE layers of (pp_rank, vp_stage)."""
    if len(found) != layout.vp_size:
        raise LayerMappingError(f"{len(found)} model chunks, but the layout has vpp={layout.vpp}")
    for c in found:
        want = layout.moe_layers(pp_rank, c.vp_stage)
        if c.layer_ids != want:
            raise LayerMappingError(
                f"pp_rank {pp_rank}, chunk {c.vp_stage}: the model's decoder routers are at layers "
                f"{c.layer_ids}, the layout expects MoE layers {want} (moe_layer_freq / pipeline split mismatch)")
