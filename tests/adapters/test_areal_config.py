"""The r3bridge: section in AReaL 1.0.4's own YAML / command line, parsed by AReaL's own parser; the
top-k check at ingest."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from r3bridge.adapters.areal.config import parse_cli
from r3bridge.adapters.areal.rollout import check_flat_topk
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.errors import RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.job_check import replay_section as section_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "areal"
LINE = [str(EXAMPLE / "gsm8k_r3bridge.py"), "--config", str(EXAMPLE / "gsm8k_megatron.yaml")]


def test_yaml_section_and_command_line_override():
    cfg = parse_cli(LINE)
    assert section_of(cfg) == ReplayConfig(replay_mode="R3", min_coverage=0.9)
    assert cfg.rollout.return_routed_experts is True                     # AReaL's own keys still parse
    # AReaL composes the YAML with hydra: a key the YAML lacks takes hydra's "+", as any AReaL key
    cfg = parse_cli(LINE + ["r3bridge.replay_mode=R2", "+r3bridge.per_layer_metrics=true"])
    assert section_of(cfg) == ReplayConfig(replay_mode="R2", min_coverage=0.9, per_layer_metrics=True)


@pytest.mark.parametrize("spelling", ["off", "disabled", "false"])
def test_off_spellings_on_areals_command_line(spelling):
    assert section_of(parse_cli(LINE + [f"r3bridge.replay_mode={spelling}"])).replay_mode is ReplayMode.OFF


def test_mistyped_key_is_refused_by_areals_parser():
    from hydra.errors import ConfigCompositionException
    with pytest.raises(ConfigCompositionException, match="r3bridge.replay_mod"):
        parse_cli(LINE + ["r3bridge.replay_mod=R3"])


def test_without_section_the_trainer_falls_back_to_the_environment(tmp_path):
    text = (EXAMPLE / "gsm8k_megatron.yaml").read_text()
    (tmp_path / "plain.yaml").write_text(text[:text.index("\nr3bridge:")] + "\n")
    assert section_of(parse_cli(["--config", str(tmp_path / "plain.yaml")])) is None
    on_line = parse_cli(["--config", str(tmp_path / "plain.yaml"), "+r3bridge.replay_mode=R3"])
    assert section_of(on_line) == ReplayConfig(replay_mode="R3")


def test_topk_mismatch_at_ingest_names_sample_token_layer_and_both_topks():
    rows = np.zeros((9, 16), dtype=np.int32)          # 4 layers x top-4, the model says top-2
    check_flat_topk(np.zeros((9, 8), dtype=np.int32), num_layers=4, topk=2, sample="query_id='q7'")
    with pytest.raises(RouteShapeError) as ei:
        check_flat_topk(rows, num_layers=4, topk=2, sample="query_id='q7'", turn=1)
    msg = str(ei.value)
    for part in ("query_id='q7'", "turn 1", "token 0", "layer 0", "top-4", "top-2"):
        assert part in msg, (part, msg)
    with pytest.raises(RouteShapeError, match="carries 3 expert ids per token and layer, the model routes top-2"):
        check_topk("'r3bridge_routes'", torch.zeros(2, 4, 3, 9).shape[2], 2, where="AReaL batch (every sample)")


def test_routes_by_reference_are_refused_when_the_actor_starts():
    """AReaL's rollout writes trajectories before the step that trains on them is known, on every
    data-parallel head (docs/route-handles.md, "AReaL: not wired (why)"): ``route_transport:
    handles`` is refused when the actor's session starts, never left on inline routes in silence."""
    from r3bridge.adapters.areal.hooks import MegatronEngineMixin
    from r3bridge.errors import ConfigError
    from r3bridge.hf import ModelInfo

    engine = type("Engine", (MegatronEngineMixin,), {})()
    engine.r3_config = ReplayConfig(replay_mode="R3", route_transport="handles")
    with pytest.raises(ConfigError, match=r"route_transport='handles': the areal adapter reads routes as inline only "
                                          r"\(routes by reference: docs/route-handles.md"):
        engine.r3_attach(ModelInfo(num_experts=4, moe_layer_ids=[1], num_layers=2, topk=2))
