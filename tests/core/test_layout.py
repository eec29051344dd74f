"""`ParallelLayout` against megatron-core 0.16.1 itself: real ``TransformerConfig``s,
``get_transformer_layer_offset`` / ``get_num_layers_to_build`` (and the layout object's own
``get_layer_offset(pp_rank=...)``), and the MoE layers ``get_gpt_decoder_block_spec`` builds."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3bridge import LayoutError, ParallelLayout

from ._reference import megatron_parallel_state

warnings.filterwarnings("ignore", category=UserWarning)

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import LayerType  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def megatron_config(num_layers, freq=1, **kw) -> TransformerConfig:
    return TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                             num_moe_experts=4, moe_layer_freq=freq, pipeline_dtype=torch.float32,
                             add_bias_linear=False,
                             **kw)


def _mlp_class(mlp_spec):
    """The MLP class a layer spec builds: a ``ModuleSpec`` (0.16-0.18) or, from 0.19, a
    ``functools.partial`` around the class or its ``as_mlp_submodule`` factory."""
    if isinstance(mlp_spec, functools.partial):
        f = mlp_spec.func
        return getattr(f, "__self__", f)
    return mlp_spec.module


def megatron_stage(cfg: TransformerConfig, pp_rank: int, vp_stage: int | None):
    """(layer range, MoE layer ids) of (pp_rank, vp_stage) as megatron-core computes them."""
    vpp = cfg.virtual_pipeline_model_parallel_size
    with megatron_parallel_state(pp_rank=pp_rank, vpp=vpp):
        layout = cfg.pipeline_model_parallel_layout
        if layout is not None:
            # get_transformer_layer_offset ignores pp_rank on this path (asks parallel_state):
            # call the layout object with pp_rank directly.
            off = layout.get_layer_offset(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
            n = layout.get_num_layers_to_build(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        else:
            off = get_transformer_layer_offset(cfg, vp_stage, pp_rank)
            n = get_num_layers_to_build(cfg, vp_stage, pp_rank)
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank)
    assert len(spec.layer_specs) == n
    moe = [off + j for j, ls in enumerate(spec.layer_specs) if _mlp_class(ls.submodules.mlp) is MoELayer]
    return range(off, off + n), moe


def assert_layout_matches_megatron(lay: ParallelLayout, cfg: TransformerConfig):
    vpp = cfg.virtual_pipeline_model_parallel_size
    seen = []
    for p in range(cfg.pipeline_model_parallel_size):
        for v in range(vpp or 1):
            rng, moe = megatron_stage(cfg, p, v if vpp is not None else None)
            assert lay.layer_range(p, v) == rng, (p, v)
            assert lay.moe_layers(p, v) == moe, (p, v)
            seen += list(rng)
    assert sorted(seen) == list(range(cfg.num_layers))


# ------------------------------------------------------------------------------ worked examples
def test_field_notes_uneven_dense_first_example():
    freq = [0, 0, 0] + [1] * 11
    lay = ParallelLayout(14, freq, pp=4, num_layers_in_first_pipeline_stage=2,
                         num_layers_in_last_pipeline_stage=4)
    assert lay.moe_layers(0) == []
    assert lay.moe_layers(1) == [3, 4, 5]
    assert lay.moe_layers(2) == [6, 7, 8, 9]
    assert lay.moe_layers(3) == [10, 11, 12, 13]
    cfg = megatron_config(14, freq, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=2,
                          num_layers_in_last_pipeline_stage=4)
    assert_layout_matches_megatron(lay, cfg)


def test_field_notes_vpp_example():
    lay = ParallelLayout(8, 1, pp=2, vpp=2)
    assert lay.moe_layers(0, 0) == [0, 1]
    assert lay.moe_layers(0, 1) == [4, 5]
    assert lay.moe_layers(1, 0) == [2, 3]
    assert lay.moe_layers(1, 1) == [6, 7]
    assert_layout_matches_megatron(lay, megatron_config(8, 1, pipeline_model_parallel_size=2,
                                                        virtual_pipeline_model_parallel_size=2))


def test_int_freq_means_i_mod_n_equals_zero():
    assert ParallelLayout(8, 2).moe_layer_ids == [0, 2, 4, 6]
    assert ParallelLayout(9, 3).moe_layer_ids == [0, 3, 6]
    assert ParallelLayout(8, 2, pp=2).moe_layers(1) == [4, 6]
    cfg = megatron_config(8, 2, pipeline_model_parallel_size=2)
    assert_layout_matches_megatron(ParallelLayout(8, 2, pp=2), cfg)


def test_layout_string_with_mtp_counts_only_decoder_layers():
    s = "Ett|(t)*3|t|t,mL"
    cfg = megatron_config(7, 1, pipeline_model_parallel_size=2, pipeline_model_parallel_layout=s,
                          mtp_num_layers=1)
    lay = ParallelLayout(7, 1, pp=2, vpp=2, pipeline_model_parallel_layout=s)
    assert [list(lay.layer_range(p, v)) for v in range(2) for p in range(2)] == [[0, 1], [2, 3, 4], [5], [6]]
    assert_layout_matches_megatron(lay, cfg)
    assert_layout_matches_megatron(ParallelLayout.from_megatron(cfg), cfg)


def test_layout_list_form_and_layer_type_members():
    rows = [[LayerType.embedding, LayerType.decoder], [LayerType.decoder] * 3,
            [LayerType.decoder, LayerType.decoder, LayerType.loss]]
    lay = ParallelLayout(6, [0, 1, 1, 0, 1, 1], pp=3, pipeline_model_parallel_layout=rows)
    assert lay.moe_layers(0) == [] and lay.moe_layers(1) == [1, 2] and lay.moe_layers(2) == [4, 5]
    cfg = megatron_config(6, [0, 1, 1, 0, 1, 1], pipeline_model_parallel_size=3,
                          pipeline_model_parallel_layout=[["embedding", "decoder"], ["decoder"] * 3,
                                                          ["decoder", "decoder", "loss"]])
    assert_layout_matches_megatron(lay, cfg)


# ------------------------------------------------------------------------------ property tests
@st.composite
def megatron_kwargs(draw):
    pp = draw(st.sampled_from([1, 2, 4]))
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    vp = vpp or 1
    kind = draw(st.sampled_from(["even", "first", "last", "both", "emb", "loss", "embloss"])) if pp > 1 else \
        draw(st.sampled_from(["even", "emb", "loss", "embloss"]))
    kw = dict(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    if kind in ("first", "last", "both"):
        first = draw(st.integers(1, 3)) * vp if kind in ("first", "both") else None
        last = draw(st.integers(1, 3)) * vp if kind in ("last", "both") else None
        mid = pp - (first is not None) - (last is not None)
        L = (first or 0) + (last or 0) + mid * vp * draw(st.integers(1, 2))
        kw.update(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    elif kind in ("emb", "loss", "embloss"):
        e, l = kind in ("emb", "embloss"), kind in ("loss", "embloss")
        per = pp * vp * draw(st.integers(1, 3))
        while per - e - l < 1:
            per += pp * vp
        L = per - e - l
        kw.update(account_for_embedding_in_pipeline_split=e, account_for_loss_in_pipeline_split=l)
    else:
        L = pp * vp * draw(st.integers(1, 3))
    fk = draw(st.sampled_from(["one", "int", "dense_first", "random"]))
    if fk == "one":
        freq = 1
    elif fk == "int":
        freq = draw(st.integers(2, 4))
    elif fk == "dense_first":
        k = draw(st.integers(1, L))
        freq = [0] * (k - 1) + [1] * (L - k + 1)
    else:
        freq = draw(st.lists(st.integers(0, 1), min_size=L, max_size=L))
    return L, freq, kw


@settings(max_examples=80, **SETTINGS)
@given(megatron_kwargs())
def test_layer_ranges_and_moe_layers_equal_megatron(args):
    L, freq, kw = args
    pp, vpp = kw["pipeline_model_parallel_size"], kw["virtual_pipeline_model_parallel_size"]
    try:
        cfg = megatron_config(L, freq, **kw)
        megatron_stage(cfg, pp - 1, vpp - 1 if vpp else None)
    except ZeroDivisionError:
        # megatron-core 0.16.1 divides by the number of middle stages in the interleaved uneven
        # offset: pp=2 with both first and last set and vpp cannot be built by megatron at all.
        assert pp == 2 and vpp
        return
    lay = ParallelLayout(
        L, freq, pp=pp, vpp=vpp,
        num_layers_in_first_pipeline_stage=kw.get("num_layers_in_first_pipeline_stage"),
        num_layers_in_last_pipeline_stage=kw.get("num_layers_in_last_pipeline_stage"),
        account_for_embedding_in_pipeline_split=kw.get("account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=kw.get("account_for_loss_in_pipeline_split", False))
    assert_layout_matches_megatron(lay, cfg)
    # from_megatron reads the same layout back
    back = ParallelLayout.from_megatron(cfg)
    assert back == lay
    assert_layout_matches_megatron(back, cfg)


@st.composite
def layout_strings(draw):
    pp = draw(st.sampled_from([2, 4]))
    vp = draw(st.sampled_from([1, 2]))
    counts = draw(st.lists(st.integers(0, 3), min_size=pp * vp, max_size=pp * vp))
    if sum(counts) == 0:
        counts[0] = 1
    stages = ["t" * c for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return pp, sum(counts), "|".join(stages)


@settings(max_examples=40, **SETTINGS)
@given(layout_strings(), st.integers(1, 3))
def test_pipeline_layout_strings_equal_megatron(args, freq):
    pp, L, s = args
    cfg = megatron_config(L, freq, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=s)
    lay = ParallelLayout(L, freq, pp=pp, vpp=cfg.virtual_pipeline_model_parallel_size,
                         pipeline_model_parallel_layout=s)
    assert_layout_matches_megatron(lay, cfg)
    assert_layout_matches_megatron(ParallelLayout.from_megatron(cfg), cfg)


# ------------------------------------------------------------------------------ from_megatron
def test_from_megatron_reads_parallel_sizes_sp_and_fp8():
    cfg = megatron_config(8, [0, 1] * 4, tensor_model_parallel_size=2, context_parallel_size=2,
                          pipeline_model_parallel_size=2, sequence_parallel=True,
                          expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    lay = ParallelLayout.from_megatron(cfg)
    assert (lay.tp, lay.cp, lay.pp, lay.vpp, lay.ep) == (2, 2, 2, None, 2)
    assert lay.sequence_parallel is True and lay.moe_layer_freq == (0, 1) * 4
    assert lay.align == 8 and lay.fp8 is False
    assert ParallelLayout.from_megatron(cfg, cp=1).align == 2
    assert ParallelLayout.from_megatron(cfg, fp8=True).align == 16


def test_from_megatron_never_takes_the_fp8_packing_from_the_model_config():
    """config.fp8 says the model computes in FP8, not how the framework packs: the FP8 padding
    rule is the framework's (verl's use_fp8_padding) and is asked for explicitly."""
    cfg = megatron_config(4, 1, tensor_model_parallel_size=2, sequence_parallel=True)
    cfg.fp8 = "hybrid"          # as on a TE model (TransformerConfig needs TE to accept it)
    lay = ParallelLayout.from_megatron(cfg)
    assert lay.fp8 is False and lay.align == 2 and lay.total_align == 1
    # 608 rows packed without FP8 padding: the plan is the 608 rows the router sees
    from r3bridge.parallel.packing import PackPlan
    plan = PackPlan.build(lay, [200, 300, 108])
    assert int(plan.padded_lens.sum()) == 608
    fp8_plan = PackPlan.build(ParallelLayout.from_megatron(cfg, fp8=True), [200, 300, 108])
    assert int(fp8_plan.padded_lens.sum()) == 768     # verl's rule, asked for: 16 per seq, total to 2*128
    off = ParallelLayout.from_megatron(megatron_config(4, 1, tensor_model_parallel_size=2))
    assert off.sequence_parallel is False and off.sp_split == 1


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kw, match", [
    (dict(num_layers=4, tp=1, sequence_parallel=True), "sequence_parallel"),
    (dict(num_layers=4, vpp=2), "vpp needs pp > 1"),
    (dict(num_layers=4, moe_layer_freq=0), "moe_layer_freq"),
    (dict(num_layers=4, moe_layer_freq=[1, 1]), "2 entries for 4 layers"),
    (dict(num_layers=4, moe_layer_freq=[1, 2, 0, 1]), "0/1"),
    (dict(num_layers=5, pp=2), "not divisible by pp=2"),
    (dict(num_layers=8, pp=2, vpp=3), "not divisible by vpp=3"),
    (dict(num_layers=4, pp=2, num_layers_in_first_pipeline_stage=0), "must be > 0"),
    (dict(num_layers=4, pp=4, num_layers_in_first_pipeline_stage=4), "no layers left"),
    (dict(num_layers=7, pp=3, num_layers_in_first_pipeline_stage=2), "cannot be split"),
    (dict(num_layers=4, pp=2, num_layers_in_first_pipeline_stage=2, account_for_loss_in_pipeline_split=True),
     "cannot be combined"),
    (dict(num_layers=4, pp=2, pipeline_model_parallel_layout="Ett|tXL"), "unknown layer letter"),
    (dict(num_layers=4, pp=2, pipeline_model_parallel_layout="Ett|tt|tL"), "not a multiple of pp=2"),
    (dict(num_layers=5, pp=2, pipeline_model_parallel_layout="Ett|ttL"), "4 decoder layers"),
    (dict(num_layers=4, tp=0), "tp must be >= 1"),
])
def test_impossible_layouts_raise_layout_error(kw, match):
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(**kw)


def test_megatron_refuses_what_we_refuse():
    """The two contract errors are megatron's own rules too."""
    with pytest.raises(Exception):  # noqa: B017  (megatron's own error type differs across versions)
        megatron_config(4, 1, tensor_model_parallel_size=1, sequence_parallel=True)
    with pytest.raises(LayoutError):
        ParallelLayout(4, 1, tp=1, sequence_parallel=True)


def test_stage_out_of_range_raises():
    lay = ParallelLayout(8, 1, pp=2, vpp=2)
    for p, v in ((2, 0), (-1, 0), (0, 2)):
        with pytest.raises(LayoutError):
            lay.moe_layers(p, v)


def test_pp1_with_embedding_and_loss_accounting_builds_every_layer():
    """megatron counts the embedding/loss stand-ins even without pipelining (4 + 1 + 1 - 1 - 1)."""
    for e, l in ((True, False), (False, True), (True, True)):
        lay = ParallelLayout(4, 1, account_for_embedding_in_pipeline_split=e, account_for_loss_in_pipeline_split=l)
        assert list(lay.layer_range(0)) == [0, 1, 2, 3]
        cfg = megatron_config(4, 1, account_for_embedding_in_pipeline_split=e, account_for_loss_in_pipeline_split=l)
        assert_layout_matches_megatron(lay, cfg)
