"""R3 and R2 on a model built by Megatron-Bridge 0.6.2's ``AutoBridge`` (issue 29, item 4).

A tiny Qwen3-MoE with a dense first layer (HF ``mlp_only_layers=[0]``; 4 layers, 8 experts top-2,
hidden 256) is written as an HF config + safetensors; ``AutoBridge.from_hf_pretrained`` builds the
Megatron model from that directory (TE layer spec, TP1, one GPU) and loads its weights; r3bridge's
HF transformers engine (:class:`r3bridge.demo.hf_engine.HFEngine`) samples rollouts from the same
weights and reports routes as vLLM / SGLang do (``testlab.hf_checks.run_rollout``). Then, on the
AutoBridge-built model, every router call is checked row by row (``RoutingProbe`` and the grid's
independent packing reference, ``tests/megatron/replay_grid.py``):

* native: a forward-only pass without replay; its agreement with the engine's routes is reported
  (with real attention on both sides it should be near 1.0);
* R3: the engine's routes replayed in a forward-only pass and a training forward + backward;
* R2: routes recorded in a forward-only (compute-log-prob) pass, replayed in a training (update)
  forward + backward and in a forward-only pass whose logits must be bit-equal to the recording's.

Pass = 0 mismatching router rows in R3 and R2, R2 logits bit-equal, no replay state left.

Run on the device (megatron-bridge's wheel set + the TE set installed; results:
docs/gpu-results/mbridge_h200_2026-11-26/). Here: ``bash scripts/gpu/bundle.sh prepare DIR te mbridge``;
on the device ``bundle.sh stash DIR/qI`` per part but the last, then, back to back:

    bash scripts/gpu/bundle.sh install DIR/qN &&
      export PYTHONPATH=$(bash scripts/gpu/bundle.sh pythonpath mbridge):$PWD NCCL_NVLS_ENABLE=0 &&
      python scripts/gpu/mbridge_autobridge.py --out $OUT/mbridge [--dtype bf16|fp32] [--dense-layers none]

(Megatron-Bridge needs megatron-core 0.19.x, which the mbridge set puts first on the path; Python 3.12 only.)

Megatron-Bridge 0.6.2's ``Qwen3MoEBridge`` does not read ``mlp_only_layers`` /
``decoder_sparse_step`` (``models/qwen/qwen3_moe_bridge.py:38-56``; its mapping registry has no
dense-MLP entry, ``:58-118``) and its GPT provider asks for one TE layer spec for every layer
(``models/gpt_provider.py:51-65``): left alone it builds layer 0 as an MoE layer and only logs
"No mapping found" for the weights it cannot place (``models/conversion/model_bridge.py:1725``).
This script therefore sets ``moe_layer_freq`` from HF's dense rule and asks for megatron's
per-layer block spec, loads the dense layer's three tensors itself, and fills every parameter with
NaN before any loader runs, so a parameter nobody loaded stops the run naming it. Everything
reported is counted in the JSON (``dense_params_loaded_by_script``).

The pure parts (config, dense-layer tensors, the NaN check, the summary) import without
megatron-bridge and are tested on the CPU in ``tests/scripts/test_mbridge_autobridge.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.abspath(os.path.join(_HERE, "..", ".."))
for p in (_ROOT, os.path.join(_ROOT, "tests", "megatron")):  # testlab/, and replay_grid's checks
    if p not in sys.path:
        sys.path.insert(0, p)

#: The tiny model (HF Qwen3-MoE arguments of ``tiny_qwen3_moe_config``).
MODEL = dict(
    num_layers=4,
    hidden_size=256,
    num_experts=8,
    topk=2,
    vocab_size=512,
    dense_layers=(0,),
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden_size=512,
    moe_ffn_hidden_size=128,
)
#: Router weights drawn with this std (the rest 0.02): with hidden 256 the router logits then
#: spread by several units, so the top-2 has clear margins and bf16 / kernel differences between
#: engine and trainer rarely flip it (a 0.02 router gives near-ties: field notes 14).
ROUTER_STD = 0.5
GROUPS = ((0, 3, 4), (1, 2, 5))  # testlab.hf_checks' two micro-batches of the six-sample rollout


def hf_config(**overrides: Any) -> Any:
    """The tiny dense-first Qwen3-MoE config (transformers only)."""
    from r3bridge.demo.hf_engine import tiny_qwen3_moe_config

    return tiny_qwen3_moe_config(**{**MODEL, **overrides})


def moe_layer_freq(cfg: Any) -> list[int]:
    """HF's dense rule as megatron's ``moe_layer_freq`` list (1 = MoE)."""
    from testlab.mbridge_spec import hf_moe_layer_freq

    freq = hf_moe_layer_freq(cfg)
    if freq is None:
        raise ValueError(f"{type(cfg).__name__} has neither mlp_only_layers nor decoder_sparse_step")
    return freq


def dense_layer_tensors(hf_state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The TE-spec names and values of every dense layer's MLP, from HF weights: r3bridge's own
    translation (``r3bridge.demo.hf_to_mcore``: ``linear_fc1 = [gate; up]``; ``to_te_names``: the
    MLP's pre-norm fused into ``linear_fc1.layer_norm_weight``)."""
    from r3bridge.demo.hf_to_mcore import hf_to_mcore, to_te_names

    te = to_te_names(hf_to_mcore(hf_state, cfg))
    dense = [i for i, moe in enumerate(moe_layer_freq(cfg)) if not moe]
    return {k: v for k, v in te.items() if any(k.startswith(f"decoder.layers.{i}.mlp.") for i in dense)}


@torch.no_grad()
def fill_nan(chunks: Sequence[torch.nn.Module]) -> None:
    for c in chunks:
        for p in c.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))


def unloaded(chunks: Sequence[torch.nn.Module]) -> list[str]:
    """Names of parameters still holding a NaN (nobody loaded them)."""
    return [
        f"chunk{ci}.{n}"
        for ci, c in enumerate(chunks)
        for n, p in c.named_parameters()
        if p.is_floating_point() and bool(torch.isnan(p).any())
    ]


@torch.no_grad()
def load_named(chunks: Sequence[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy ``tensors`` into the same-named parameters of chunk 0 (TP1); every name must exist."""
    params = dict(chunks[0].named_parameters())
    missing = sorted(set(tensors) - set(params))
    if missing:
        raise KeyError(f"the AutoBridge-built model has no parameters {missing}")
    for name, t in tensors.items():
        if tuple(params[name].shape) != tuple(t.shape):
            raise ValueError(f"{name}: model shape {tuple(params[name].shape)}, HF gives {tuple(t.shape)}")
        params[name].copy_(t.to(params[name].dtype))
    return sorted(tensors)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """The one-line summary: pass iff every replayed router row matched and R2 is bit-exact."""
    agree, total = res.get("native_agree_rows", 0), res.get("native_rows", 0)
    out = dict(res)
    out["native_agreement"] = round(agree / total, 6) if total else None
    out["pass"] = bool(
        res.get("r3_rows", 0) > 0
        and res.get("r2_rows", 0) > 0
        and res.get("r3_mismatching_rows") == 0
        and res.get("r2_mismatching_rows") == 0
        and res.get("r2_logits_bit_equal") is True
        and res.get("state_clean") is True
        and not res.get("errors")
    )
    return out


def checkpoint_expert_layout(hf_dir: str) -> str:
    """ "per-expert" or "fused": Qwen3MoEBridge 0.6.2 maps only per-expert HF names
    (``models/qwen/qwen3_moe_bridge.py:90-111``); transformers' ``save_pretrained`` writes those."""
    from safetensors import safe_open

    keys: list[str] = []
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "pt") as f:
                keys += list(f.keys())
    fused = any(k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for k in keys)
    per_expert = any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
    return "mixed" if fused and per_expert else "fused" if fused else "per-expert" if per_expert else "none"


@torch.no_grad()
def logprob_gap(
    hf_model: torch.nn.Module, tokens: Sequence[Sequence[int]], batches: Sequence[Any], results: Sequence[Any]
) -> dict[str, float]:
    """Trainer (native routing) vs the engine's model: log-probs of the same tokens. Context for the
    native agreement (a wrong rope / norm mapping would show here first), not a pass criterion."""
    dev = next(hf_model.parameters()).device
    diffs = []
    for grp, b, r in zip(GROUPS, batches, results):
        lp = torch.log_softmax(r.logits.float(), -1).gather(-1, b.labels.to(r.logits.device)[:, None]).squeeze(-1)
        for j, i in enumerate(grp):
            ids = torch.as_tensor([list(tokens[i])], device=dev)
            ref = torch.log_softmax(hf_model(input_ids=ids).logits[0, :-1].float(), -1)
            ref = ref.gather(-1, ids[0, 1:, None]).squeeze(-1)
            off, n = int(b.cu_seqlens_padded[j]), len(tokens[i]) - 1
            diffs.append((lp[off : off + n].to(ref.device) - ref).abs())
    d = torch.cat(diffs) if diffs else torch.zeros(1)
    return {"native_logprob_absdiff_max": float(d.max()), "native_logprob_absdiff_mean": float(d.mean())}


# ------------------------------------------------------------------------------------ GPU part


def _ctx() -> Any:
    from r3bridge.testing.harness.dist import RankContext

    return RankContext(
        rank=0,
        world_size=1,
        tp=1,
        pp=1,
        vpp=None,
        cp=1,
        ep=1,
        etp=1,
        dp=1,
        tp_rank=0,
        pp_rank=0,
        cp_rank=0,
        ep_rank=0,
        etp_rank=0,
        dp_rank=0,
        seed=0,
    )


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(m, "decoder") and hasattr(m, "module"):
        m = m.module
    return m


def build_autobridge(
    hf_dir: str, cfg: Any, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, report: dict[str, Any]
) -> list[torch.nn.Module]:
    """AutoBridge 0.6.2: ``from_hf_pretrained`` (``models/conversion/auto_bridge.py:459``),
    ``to_megatron_provider(load_weights=True)`` (``:1638``; registers the weight loader as a
    pre-wrap hook, ``:1683-1690``), ``apply_overrides_and_finalize`` and
    ``provide_distributed_model`` (``models/model_provider.py:143``, ``:186``; it initialises
    torch.distributed and megatron's parallel state for one rank itself, ``:236-249``)."""
    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider(load_weights=True)
    report["bridge_moe_layer_freq"] = getattr(provider, "moe_layer_freq", None)
    freq = moe_layer_freq(cfg)

    def block_spec(config: Any, vp_stage: int | None = None) -> Any:
        # megatron's per-layer spec honours moe_layer_freq (dense layer 0); TE as the bridge asks
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)

    provider.apply_overrides_and_finalize(
        dtype=dtype,
        overrides={
            "moe_layer_freq": freq,
            "transformer_layer_spec": block_spec,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 1,
            "sequence_parallel": False,
            # the provider defaults to True, which needs APEX's fused_weight_gradient_mlp_cuda (not on
            # the image: "ColumnParallelLinear was called with gradient_accumulation_fusion set to
            # True but ...", first device run 2026-11-26); it changes how grads accumulate, not routing
            "gradient_accumulation_fusion": False,
        },
    )
    bridge_load: Callable = provider.pre_wrap_hook  # the bridge's HF loader (composed hooks)
    dense = {k: v for k, v in dense_layer_tensors(hf_state, cfg).items()}

    def nan_first(model: list) -> list:
        fill_nan([_unwrap(m) for m in model])
        return model

    def dense_after(model: list) -> list:
        report["dense_params_loaded_by_script"] = load_named([_unwrap(m) for m in model], dense)
        return model

    def none_left(model: list) -> list:
        left = unloaded([_unwrap(m) for m in model])
        if left:
            raise RuntimeError(f"parameters neither AutoBridge nor this script loaded: {left}")
        return model

    hooks = [nan_first] + ([bridge_load] if bridge_load else []) + [dense_after, none_left]
    model = provider.provide_distributed_model(wrap_with_ddp=False, mixed_precision_wrapper=None, pre_wrap_hook=hooks)
    chunks = [_unwrap(m) for m in model]
    report["megatron_model"] = type(chunks[0]).__name__
    report["layer_mlps"] = [type(layer.mlp).__name__ for layer in chunks[0].decoder.layers]
    report["experts_impl"] = sorted(
        {type(layer.mlp.experts).__name__ for layer in chunks[0].decoder.layers if hasattr(layer.mlp, "experts")}
    )
    report["provider"] = {
        k: getattr(provider, k, None)
        for k in (
            "moe_grouped_gemm",
            "moe_permute_fusion",
            "moe_router_fusion",
            "moe_token_dispatcher_type",
            "moe_router_pre_softmax",
            "moe_router_load_balancing_type",
            "qk_layernorm",
            "bf16",
            "params_dtype",
        )
    }
    report["provider"]["params_dtype"] = str(report["provider"]["params_dtype"])
    return chunks


def run(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """The GPU run; ``res`` fills as it goes (what was reached is reported if a later stage fails)."""
    from replay_grid import _check_probe, _install_step

    from r3bridge.demo.hf_engine import HFEngine, build_hf_model
    from r3bridge.megatron import Replayer
    from r3bridge.testing.harness.data import batch_to
    from r3bridge.testing.harness.probe import RoutingProbe
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule
    from testlab.hf_checks import _batches, run_rollout

    t0 = time.time()
    try:
        import megatron.bridge  # noqa: F401  (first: a missing wheel set should say so, not a CUDA error)
    except ImportError as e:
        raise ImportError(
            f"megatron-bridge is not importable ({e}): install scripts/gpu/wheels/mbridge.txt "
            "on top of the TE set (docs/gpu.md, Megatron-Bridge)"
        ) from e
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    res.update(dtype=args.dtype, errors=[])
    for mod in ("megatron.bridge", "megatron.core", "transformer_engine", "transformers", "torch"):
        try:
            res.setdefault("versions", {})[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception as e:  # reported, the run goes on: versions are context only
            res.setdefault("versions", {})[mod] = f"unknown ({type(e).__name__})"
    res["device"] = torch.cuda.get_device_name(0)

    dense = () if args.dense_layers == "none" else tuple(int(i) for i in args.dense_layers.split(","))
    res["dense_layers"] = list(dense)
    cfg = hf_config(dense_layers=dense)
    model = build_hf_model(cfg, seed=args.seed, router_std=args.router_std)
    hf_state = {k: v.clone() for k, v in model.state_dict().items()}
    tmp = tempfile.mkdtemp(prefix="r3b-mbridge-")
    model.save_pretrained(tmp, safe_serialization=True)
    res["hf_checkpoint_experts"] = checkpoint_expert_layout(tmp)
    # The engine holds the same weights rounded to bf16 and runs fp32 (as testlab.hf_checks):
    # a serving engine's numerics differ from the trainer's.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    engine = HFEngine(model.cuda())
    ro = run_rollout(engine, seed=args.seed)
    res["rollout"] = {
        "samples": len(ro.tokens),
        "seq_lens": [len(t) for t in ro.tokens],
        "valid_rows": int(ro.routes.valid.sum()),
        "rows": ro.routes.total_rows,
        "stitch_overlap": ro.stitch_overlap,
        "stitch_disagreeing": ro.stitch_disagreeing,
    }

    chunks = build_autobridge(tmp, cfg, hf_state, dtype, res)
    ctx = _ctx()
    cpu_batches, _ = _batches(ro, ctx)
    batches = [batch_to(b, "cuda") for b in cpu_batches]
    ids = {id(b): list(g) for b, g in zip(batches, GROUPS)}
    routes = [ro.routes.select(list(g)) for g in GROUPS]
    by_batch = {id(b): r for b, r in zip(batches, routes)}
    rep = Replayer(chunks)
    moe_layers = list(rep.layer_ids)
    res["replayer_layers"] = moe_layers
    want_layers = [i for i, f in enumerate(moe_layer_freq(cfg)) if f]
    if moe_layers != want_layers:
        res["errors"].append(f"the Replayer hooks layers {moe_layers}, HF's MoE layers are {want_layers}")
    hooks_before = [(len(c._forward_pre_hooks), len(c._forward_hooks)) for c in chunks]
    fwd = make_forward_step(ctx, thd=True, collect_logits=True)

    def checked(
        action: str, forward_only: bool, route_kind: str | None, want: list, train: bool, route_map: dict, tag: str
    ) -> tuple[dict, list]:
        for c in chunks:
            c.train(train)
            c.zero_grad(set_to_none=True)
        counts: dict[str, int] = {}
        with RoutingProbe(chunks, include_mtp=False) as probe:
            with rep.open_pass(action, forward_only=forward_only, route_kind=route_kind) as st:
                out = run_schedule(chunks, batches, _install_step(st, fwd, route_map, ids), forward_only=forward_only)
        errs = _check_probe(probe, cpu_batches, want, ctx, False, False, moe_layers, counts)
        res[f"{tag}_metrics"] = {k: v for k, v in st.metrics.items() if isinstance(v, (int, float))}
        return {"errors": errs, **counts, "step": st}, out

    # 1. native (no replay): the trainer's own top-k against the engine's routes
    nat, nat_out = checked("native", True, None, routes, False, {}, "native")
    res.update(logprob_gap(engine.model, ro.tokens, cpu_batches, nat_out))
    res["native_calls"], res["native_rows"] = nat["calls"], nat["rows"]
    res["native_agree_rows"] = nat["rows"] - nat["mismatching_rows"]
    # 2. R3: the engine's routes, forward-only (old log-prob) and training (update)
    for tag, fo in (("r3_fwd", True), ("r3_train", False)):
        r, _ = checked("replay", fo, "rollout", routes, not fo, by_batch, tag)
        res[f"{tag}_calls"], res[f"{tag}_rows"], res[f"{tag}_mismatching_rows"] = (
            r["calls"],
            r["rows"],
            r["mismatching_rows"],
        )
        res["errors"] += [f"{tag}: {e}" for e in r["errors"]]
    res["r3_rows"] = res["r3_fwd_rows"] + res["r3_train_rows"]
    res["r3_mismatching_rows"] = res["r3_fwd_mismatching_rows"] + res["r3_train_mismatching_rows"]
    # 3. R2: record in a compute-log-prob pass, replay in an update pass and a forward-only pass
    for c in chunks:
        c.eval()
    with rep.open_pass("record", forward_only=True) as rec:
        rec_out = run_schedule(chunks, batches, _install_step(rec, fwd, {}, ids), forward_only=True)
    recorded = rec.recorded
    rec_routes = [recorded.select(list(g)) for g in GROUPS]
    rec_by_batch = {id(b): r for b, r in zip(batches, rec_routes)}
    r2u, _ = checked("replay", False, "recorded", rec_routes, True, rec_by_batch, "r2_update")
    r2f, rep_out = checked("replay", True, "recorded", rec_routes, False, rec_by_batch, "r2_fwd")
    res["r2_update_calls"], res["r2_fwd_calls"] = r2u["calls"], r2f["calls"]
    res["r2_rows"] = r2u["rows"] + r2f["rows"]
    res["r2_mismatching_rows"] = r2u["mismatching_rows"] + r2f["mismatching_rows"]
    res["errors"] += [f"r2: {e}" for e in r2u["errors"] + r2f["errors"]]
    res["r2_logits_bit_equal"] = bool(rec_out) and all(
        torch.equal(a.logits, b.logits) for a, b in zip(rec_out, rep_out)
    )
    res["r2_logits_maxdiff"] = max(
        [float((a.logits.float() - b.logits.float()).abs().max()) for a, b in zip(rec_out, rep_out)] or [0.0]
    )
    res["state_clean"] = rep.active_pass is None and hooks_before == [
        (len(c._forward_pre_hooks), len(c._forward_hooks)) for c in chunks
    ]
    res["seconds"] = round(time.time() - t0, 2)
    return summarize(res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for summary.json")
    ap.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="the AutoBridge model's parameter dtype (default bf16, as Qwen3MoEBridge sets)",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--router-std", type=float, default=ROUTER_STD)
    ap.add_argument(
        "--dense-layers",
        default=",".join(str(i) for i in MODEL["dense_layers"]),
        help="HF mlp_only_layers, comma separated, or 'none' (every layer MoE). Megatron-Bridge 0.6.2 "
        "cannot load a dense-first checkpoint: its conversion tasks hold None for the dense MLP's "
        "parameters and load_weights_hf_to_megatron dereferences them (model_bridge.py:1100, "
        "AttributeError: 'NoneType' object has no attribute 'megatron_module', 2026-11-26)",
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    partial: dict[str, Any] = {}
    try:
        summary = run(args, partial)
    except Exception as e:  # the lead reads one line either way; the traceback follows on stderr
        import traceback

        traceback.print_exc()
        summary = {**partial, "pass": False, "error": f"{type(e).__name__}: {e}"}
    line = json.dumps(summary, sort_keys=True, default=str)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        f.write(line + "\n")
    print(line)
    return 0 if summary.get("pass") else 1


if __name__ == "__main__":
    raise SystemExit(main())
