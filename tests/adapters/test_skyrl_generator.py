"""FirstSeenRoutesMixin on SkyRL 0.3.0's real ``SkyRLGymGenerator`` state-update methods, with its
real ``AgentLoopState`` / ``TurnOutput`` dataclasses. The generator object is created with
``object.__new__`` and only the attributes those two methods read (its constructor needs an
inference client, a tokenizer and environments); the turn payloads are vLLM's routes in SkyRL's
JSON form. Plus PolicyWorkerMixin's config handling on a stand-in worker base
(``megatron_worker`` imports ``megatron.bridge``, not installable here)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from r3bridge.adapters.skyrl import FirstSeenRoutesMixin, PolicyWorkerMixin  # noqa: E402
from r3bridge.adapters.skyrl._compat import import_skyrl  # noqa: E402

gen_mod = import_skyrl("skyrl.train.generators.skyrl_gym_generator")


def _routes(rows, seed):
    rng = np.random.default_rng(seed)
    return np.argsort(-rng.random((rows, 3, 6)), axis=-1)[..., :2].tolist()


def _generator(cls):
    g = object.__new__(cls)
    g.generator_cfg = SimpleNamespace(step_wise_trajectories=False,
                                      inference_engine=SimpleNamespace(enable_return_routed_experts=True))
    g.tokenizer = SimpleNamespace(eos_token_id=2, eos_token="</s>")
    return g


def _run_turns(gen, method):
    prompt = [5, 6, 7, 8]
    state = gen_mod.AgentLoopState(chat_history=[], input_ids=list(prompt), loss_mask=[], rollout_logprobs=None,
                                   response_end_idx=None, done=False, rollout_expert_indices=[])
    turns = [([11, 12, 2], [30, 31]), ([13, 14, 2], [32])]
    seen = []
    for t, (out_ids, obs) in enumerate(turns):
        rows = len(state.input_ids) + len(out_ids) - 1           # vLLM: prompt + generated - 1
        routes = _routes(rows, t)
        seen.append(routes)
        turn = gen_mod.TurnOutput(output="x", output_ids=list(out_ids), output_logprobs=None, new_obs=[],
                                  obs_ids=list(obs), rollout_expert_indices=routes, reward=None)
        state = getattr(gen, method)(state, turn)
    return state, seen


@pytest.mark.parametrize("method", ["_update_agent_loop_state_with_multiturn_chat_template",
                                    "_update_agent_loop_state_with_singleturn_chat_template"])
def test_first_seen_routes_mixin(method):
    base = gen_mod.SkyRLGymGenerator
    cls = type("G", (FirstSeenRoutesMixin, base), {})
    skyrl_state, seen = _run_turns(_generator(base), method)
    ours, _ = _run_turns(_generator(cls), method)
    first, second = seen
    assert skyrl_state.rollout_expert_indices == second                         # SkyRL: last turn overwrites
    assert ours.rollout_expert_indices[: len(first)] == first                     # r3bridge: first-seen
    assert ours.rollout_expert_indices[len(first):] == second[len(first):]
    assert len(ours.rollout_expert_indices) == len(second)


def test_policy_worker_mixin_keeps_megatron_replay_off():
    class Base:
        def init_configs(self, model_path, megatron_config, *a, **k):
            self.enable_router_replay = megatron_config.moe_enable_routing_replay
            self.seen = megatron_config

    class W(PolicyWorkerMixin, Base):
        pass
    w = W()
    mc = SimpleNamespace(moe_enable_routing_replay=True, other=1)   # SkyRL's validate_cfg wants it True
    w.init_configs("m", mc)
    assert w.enable_router_replay is False and w.seen.other == 1
    assert mc.moe_enable_routing_replay is True                    # the user's config object is untouched


def test_launcher_generator_is_first_seen_on_03_and_refuses_its_vlm():
    """SkyRL 0.3: the launcher's experiment builds r3bridge's first-seen generator (a real one, from
    a real tokenizer; no engine client: it only keeps it); 0.3's VLM generator is refused, not
    silently replaced by the text one. (0.4: tests/adapters/test_skyrl04.py, its own generator.)"""
    import tempfile

    import r3bridge.adapters.skyrl.experiment as launcher
    from r3bridge.adapters.skyrl.config import parse_cli
    from r3bridge.errors import ConfigError
    from testlab.verl_e2e import write_tokenizer

    exp = object.__new__(launcher.Exp)      # BasePPOExp.__init__ loads datasets; get_generator needs none
    tok = write_tokenizer(tempfile.mkdtemp())
    gen = launcher.Exp.get_generator(exp, parse_cli([]), tok, None)
    assert isinstance(gen, FirstSeenRoutesMixin) and isinstance(gen, gen_mod.SkyRLGymGenerator)
    with pytest.raises(ConfigError, match="vision_language_generator needs SkyRL 0.4"):
        launcher.Exp.get_generator(exp, parse_cli(["generator.vision_language_generator=true"]), tok, None)
