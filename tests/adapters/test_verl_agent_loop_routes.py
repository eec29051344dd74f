"""``VerlRollout.sample_rows``: one agent-loop sample's server calls -> first-seen rows in
verl's transport, re-prefill disagreements counted (what ``FirstSeenToolAgentLoop`` stores; the
whole loop runs in tests/adapters/test_verl_e2e.py); with routes by reference, what the agent
loop's writer stores and when the engine releases a step's files."""
from __future__ import annotations

import os

import numpy as np
import pytest

from r3bridge.adapters.verl.rollout import VerlRollout
from r3bridge.errors import RouteShapeError

LAYERS, E, K = 3, 8, 2


def _call(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, LAYERS, K), dtype=np.uint8)
    for r in range(rows):
        for layer in (1, 2):
            out[r, layer] = rng.choice(E, size=K, replace=False)
    return out


def _rollout() -> VerlRollout:
    return VerlRollout(num_experts=E, moe_layer_ids=[1, 2], num_hidden_layers=LAYERS, topk=K)


def test_first_seen_rows_win_and_disagreements_are_counted():
    first = _call(6, 0)
    second = np.concatenate([first, _call(4, 1)])          # turn 2 re-sends turn 1's 6 rows
    # the re-prefill routed token 2 elsewhere in layer 1
    second[2, 1] = [e for e in range(E) if e not in set(first[2, 1].tolist())][:K]
    routes, report = _rollout().sample_rows([first, second], sample="abc")
    assert routes.shape == (10, LAYERS, K) and routes.dtype == first.dtype
    assert np.array_equal(routes[:6], first)                # first-seen: the rows that sampled the tokens
    assert np.array_equal(routes[6:], second[6:])
    assert report.overlap_rows == [6] and report.total_disagreeing == 1
    # verl 0.9.1's tool loop would have kept `second`, whose row 2 differs
    assert not np.array_equal(second[:6], routes[:6])


def test_read_only_server_arrays_are_stitched_without_a_warning_and_left_unchanged():
    """A server's ``routed_experts`` reach the agent loop through Ray's object store as read-only
    arrays: the stitch copies what it writes (issue 50: 'The given NumPy array is not writable'
    from r3bridge's stitching on every verl run) and leaves the server's arrays as they were."""
    import warnings

    first = _call(6, 0)
    second = np.concatenate([first, _call(4, 1)])
    second[2, 1] = [e for e in range(E) if e not in set(first[2, 1].tolist())][:K]
    before = [first.copy(), second.copy()]
    for a in (first, second):
        a.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routes, report = _rollout().sample_rows([first, second], sample="abc")
    assert np.array_equal(routes[:6], before[0]) and np.array_equal(routes[6:], before[1][6:])
    assert np.array_equal(first, before[0]) and np.array_equal(second, before[1])
    assert report.total_disagreeing == 1


def test_call_shape_and_topk_are_checked_naming_the_sample():
    with pytest.raises(RouteShapeError, match=r"sample abc: server call 1 .* num_hidden_layers=3"):
        _rollout().sample_rows([_call(4, 0), np.zeros((6, 2, K), np.uint8)], sample="abc")
    with pytest.raises(RouteShapeError, match=r"server call 0 returned routed_experts with top-k 3, the model routes top-2"):
        _rollout().sample_rows([np.zeros((4, LAYERS, 3), np.uint8)])


def test_from_hf_config():
    from testlab.mbridge_spec import tiny_qwen3_moe

    r = VerlRollout.from_hf_config(tiny_qwen3_moe(num_layers=4, dense=(0,), num_experts=8, topk=2))
    assert (r.num_hidden_layers, r.moe_layer_ids, r.num_experts, r.topk) == (4, [1, 2, 3], 8, 2)


def test_call_provenance_from_verl_token_outputs():
    """What ``FirstSeenToolAgentLoop`` stamps per sample, from verl's own ``TokenOutput``: the first
    call's pass for the routes (``global_steps``, ``num_preempted`` as epoch), its first pass
    (epoch 0, ``min_global_steps``) for the log-probs."""
    from verl.workers.rollout.replica import TokenOutput

    from r3bridge.adapters.verl.rollout import call_provenance
    from r3bridge.batch.provenance import RouteProvenance
    from r3bridge.errors import ProvenanceError

    preempted = TokenOutput(token_ids=[1], num_preempted=2, extra_fields={"global_steps": 7, "min_global_steps": 6})
    later = TokenOutput(token_ids=[2], num_preempted=0, extra_fields={"global_steps": 8})
    routes, logprobs = call_provenance([preempted, later], engine="sglang", request_id="r1")
    assert routes == RouteProvenance("sglang", "r1", 7, 2)
    assert logprobs == RouteProvenance("sglang", "r1", 6, 0)
    assert routes.differences(logprobs) == ("weight_version", "epoch")
    # verl's "not available" values: num_preempted -1 / None, global_steps None before training
    unknown = TokenOutput(token_ids=[1], num_preempted=-1, extra_fields={"global_steps": None})
    routes, logprobs = call_provenance([unknown], engine="vllm")
    assert (routes.weight_version, routes.epoch, logprobs.weight_version) == (None, None, None)
    with pytest.raises(ProvenanceError, match="no server call"):
        call_provenance([], engine="vllm", request_id="r2")


def test_a_regenerated_turn_starts_the_next_attempt():
    """The agent loop's capture numbers attempts (NeMo RL #4057): a call that continues the context
    stays in the attempt, a call that regenerates a turn (its prompt drops the previous output) is
    a retry. First-seen keeps attempt 0's rows for the retried turn while the sample keeps attempt
    1's tokens: the provenance pair differs in ``attempt``, so provenance_check counts or refuses it."""
    import asyncio

    from verl.workers.rollout.replica import TokenOutput

    from r3bridge.adapters.verl.calls import CapturingClient
    from r3bridge.adapters.verl.rollout import call_provenance

    class Server:
        def __init__(self):
            self.n = 0

        async def generate(self, request_id, *, prompt_ids, sampling_params):
            self.n += 1
            return TokenOutput(token_ids=[100 + self.n, 200 + self.n], routed_experts=_call(len(prompt_ids) + 1, self.n),
                               extra_fields={"global_steps": 3})

    capture = CapturingClient(Server())

    async def loop():
        first = await capture.generate("r", prompt_ids=[1, 2, 3], sampling_params={})
        turn2 = [1, 2, 3, *first.token_ids, 9]                       # the context continues: same attempt
        await capture.generate("r", prompt_ids=turn2, sampling_params={})
        await capture.generate("r", prompt_ids=turn2, sampling_params={})    # turn 2 generated again: a retry
    asyncio.run(loop())
    assert capture.attempts == [0, 0, 1]
    routes, logprobs = call_provenance(capture.outputs, engine="vllm", request_id="r", attempts=capture.attempts)
    assert (routes.attempt, logprobs.attempt) == (0, 1) and routes.differences(logprobs) == ("attempt",)


def test_route_writer_stores_the_moe_layers_of_the_routed_rows_once(tmp_path):
    """route_transport: handles: what an agent loop stores for one finished sample (verl's
    ``routed_experts``, every decoder layer, zero rows after the last fed token): the MoE layers of
    the routed rows, read back exactly through the reader's ``resolve``; an unrouted row before a
    routed one is refused, naming the sample."""
    from r3bridge.adapters.verl.route_handles import RouteWriter
    from r3bridge.config import ReplayConfig
    from r3bridge.errors import CoverageError
    from r3bridge.handles import RouteHandle, resolve
    from r3bridge.handles.backends import FileRoutes

    cfg = ReplayConfig(replay_mode="R3", route_transport="handles", route_store=str(tmp_path))
    writer = RouteWriter(cfg, moe_layer_ids=[1, 2], num_hidden_layers=LAYERS, num_experts=E, run_id="run1")
    routes = np.concatenate([_call(9, 3), np.zeros((2, LAYERS, K), dtype=np.uint8)])   # 2 unfed rows
    h = RouteHandle.from_json(writer.put(routes, step=4, sample="uid7_1_x"))
    assert (h.rows, h.layer_ids, h.step, h.run_id, h.key) == (9, (1, 2), 4, "run1", "run1/4/uid7_1_x")
    got = resolve(h, {"files": FileRoutes(str(tmp_path))})
    assert np.array_equal(got, routes[:9, 1:].astype(np.int16))
    holed = routes.copy()
    holed[4] = 0
    with pytest.raises(CoverageError, match="sample 'uid7_1_y': row 4 has no route"):
        writer.put(holed, step=4, sample="uid7_1_y")


@pytest.mark.parametrize("trace_dir", [None, "traces"])
def test_the_steps_routes_go_after_its_last_update_pass_unless_traced(tmp_path, trace_dir):
    """The engine's lifetime rule: compute_log_prob and the update's earlier mini-batches keep the
    step's files; after the last update pass (verl's ``update_lr_scheduler``) the releasing rank
    deletes every file the step's update passes read, unless ``trace_dir`` keeps them for traces.
    Validation rollouts' routes (written by the same agent loops for the validating step: before
    training, step 0, and after step 1's update, step 1; no update pass reads them) go with the
    next step's release when that step trained on one step's samples; the next step's own files stay
    until then."""
    from r3bridge.adapters.verl.route_handles import RouteHandles, RouteWriter
    from r3bridge.config import ReplayConfig
    from r3bridge.handles import RouteHandle

    store = tmp_path / "store"
    cfg = ReplayConfig(replay_mode="R3", route_transport="handles", route_store=str(store),
                       trace_dir=None if trace_dir is None else str(tmp_path / trace_dir))
    writer = RouteWriter(cfg, moe_layer_ids=[1, 2], num_hidden_layers=LAYERS, num_experts=E, run_id="run2")

    def put(step: int, count: int, kind: str) -> list:
        return [RouteHandle.from_json(writer.put(_call(5, s), step=step, sample=f"{kind}{s}_0_x"))
                for s in range(count)]

    def files() -> int:
        return sum(len(f) for _, _, f in os.walk(store))
    put(0, 3, "val")                        # val_before_train: verl's _validate at global step 0
    handles = put(1, 4, "uid")
    engine = RouteHandles(cfg, run_id="run2")
    for batch, update, last in ((handles, False, False), (handles[:2], True, False), (handles[2:], True, True)):
        engine.batch = list(batch)          # what take() read from the pass's batch
        released = engine.pass_done(update=update, last_of_step=last, releases=True)
        assert files() == (7 if not last or trace_dir else 0)
    assert released == (0 if trace_dir else 4 + 3)
    put(1, 2, "val")                        # the validation after step 1's update: written for step 1
    step2 = put(2, 2, "uid")
    assert files() == (7 + 4 if trace_dir else 4)
    engine.batch = step2
    released = engine.pass_done(update=True, last_of_step=True, releases=True)
    assert files() == (7 + 4 if trace_dir else 0) and released == (0 if trace_dir else 2 + 2)
    assert trace_dir or os.listdir(store) == []           # no folder left either
    # an off-policy step (it trained on samples of two steps) leaves older steps' files alone: an
    # older prompt still in flight may be trained on later
    put(2, 1, "val")
    late, step3 = put(2, 1, "late"), put(3, 1, "uid")
    engine.batch = late + step3
    released = engine.pass_done(update=True, last_of_step=True, releases=True)
    assert files() == (7 + 4 + 3 if trace_dir else 1) and released == (0 if trace_dir else 2)
