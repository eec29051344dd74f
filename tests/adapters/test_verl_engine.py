"""The registered engine's phase logic on real megatron-core chunks (CPU harness).

Each engine is the adapter's ``R3BridgeMegatronEngine`` built by ``_verl_runner.build_engine``:
only verl's schedule call and the model-running body of ``forward_step`` are stood in for; the
driver is the real :class:`r3bridge.megatron.Replayer` attached by the engine's own
``r3_attach``; verl's ``prepare_micro_batches`` (dynamic batch size: samples re-ordered),
batch generator, THD packing and ``postprocess_batch_func`` run. Assertions are about what really
happened: what every router dispatched (:class:`r3bridge.testing.harness.probe.RoutingProbe`), the
driver's metrics as verl's output carries them, the R2 recording verl gets back.

One pair of processes: PP 2 x VPP 2 (every micro-batch crosses two chunks per rank; the first
stage gets no output) for replay, recording and metrics; then no model parallelism (each rank on
its own) for reference passes, config errors and a failing schedule.
"""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import verl  # noqa: F401  (installed by `make install`: never skipped)

from r3bridge.testing.harness.dist import Layout, spawn_layouts

SEED, BATCH = 11, 8
MAX_TOKENS = (30, 24)           # verl's max_token_len_per_gpu of the two passes: different re-orderings


# ---------------------------------------------------------------------------------- rank helpers
def _spec():
    from r3bridge.testing.harness.models import ModelSpec

    return ModelSpec(num_layers=4, moe_layer_freq=[0, 1, 1, 1], attention="identity",
                     moe_token_dispatcher_type="alltoall", extra_config={"variable_seq_lengths": True})


def _setup(ctx, mode: str, *, reference: bool = False, **options):
    """(rollout, engine over fresh harness chunks, verl's batch of the rollout with routes)."""
    import torch
    from _verl_batches import verl_batch
    from _verl_runner import INDEX_KEY, build_engine

    from r3bridge.testing.harness.models import build_model_chunks
    from r3bridge.testing.kit.conformance import make_rollout

    spec = _spec()
    rollout = make_rollout(SEED, batch_size=BATCH, num_experts=spec.num_moe_experts, topk=spec.moe_router_topk)
    eng = build_engine(ctx, build_model_chunks(spec, ctx), mode, reference=reference, **options)
    td = verl_batch(rollout)
    td[INDEX_KEY] = torch.arange(BATCH)
    return rollout, eng, td


def _run(eng, td, *, forward_only: bool, max_tokens: int = MAX_TOKENS[0]):
    """One ``forward_backward_batch`` (compute_log_prob or update) micro-batched by verl's
    dynamic batch size; returns (verl's output, the probe of every router call)."""
    from verl.utils import tensordict_utils as tu

    from r3bridge.testing.harness.probe import RoutingProbe

    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_tokens)
    for c in eng.module:                            # verl's EngineEvalModeCtx / EngineTrainModeCtx
        c.train(not forward_only)
    eng.fed.clear()
    with RoutingProbe(eng.module, include_mtp=False) as probe:
        out = eng.forward_backward_batch(td, None, forward_only=forward_only)
    if not forward_only:
        for c in eng.module:                        # the update's gradients are not stepped here
            for p in c.parameters():
                p.grad = None
    return out, probe


def _fed_by_chunk(eng) -> dict[int, list]:
    """chunk -> [(rollout samples, packed stream)] of each forward step verl ran on it, in order."""
    fed: dict[int, list] = {}
    for c, samples, packed in eng.fed:
        fed.setdefault(c, []).append((samples, packed))
    return fed


def _dispatch_errors(ctx, eng, probe, expected) -> tuple[list[str], int]:
    """Compare every router call with ``expected`` (sample order) sharded for the micro-batch
    verl fed that chunk: (errors, valid rows checked)."""
    from r3bridge.parallel.sharding import shard

    layout = eng.r3.replayer.layout
    fed = _fed_by_chunk(eng)
    calls: dict[tuple[int, int], list] = {}
    for call in probe.calls:
        calls.setdefault((call.chunk, call.layer_id), []).append(call)
    errors, checked = [], 0
    for (c, lid), cs in calls.items():
        if len(cs) != len(fed.get(c, [])):
            errors.append(f"chunk {c} layer {lid}: {len(cs)} router calls, {len(fed.get(c, []))} forward steps")
            continue
        for m, (call, (samples, packed)) in enumerate(zip(cs, fed[c])):
            tg = shard(expected.select(samples), layout, packed.seq_lens, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                       pp_rank=ctx.pp_rank, vp_stage=c, layer_ids=[lid], format="thd",
                       cu_seqlens_padded=packed.cu_seqlens_padded)
            got, want, v = call.topk(), tg.indices[lid].sort(dim=1).values, tg.valid
            if got.shape != want.shape:
                errors.append(f"layer {lid} micro-batch {m}: {tuple(got.shape)} rows routed, {tuple(want.shape)} targets")
            elif not bool((got[v] == want[v]).all()):
                errors.append(f"layer {lid} micro-batch {m} samples {samples}: "
                              f"{int((got[v] != want[v]).any(1).sum())} valid rows differ")
            checked += int(v.sum())
    return errors, checked


def _dispatched(eng, probe) -> dict[tuple[int, int], Any]:
    """(sample, layer) -> the [rows, K] experts its tokens were dispatched to (no TP/CP split)."""
    out, fed = {}, _fed_by_chunk(eng)
    seen: dict[tuple[int, int], int] = {}
    for call in probe.calls:
        k = seen[(call.chunk, call.layer_id)] = seen.get((call.chunk, call.layer_id), -1) + 1
        samples, packed = fed[call.chunk][k]
        top = call.topk()
        for s, off, n in zip(samples, packed.cu_seqlens_padded.tolist(), packed.seq_lens):
            out[(s, call.layer_id)] = top[off:off + n]
    return out


def _hook_count(eng) -> int:
    """Forward hooks on every module of the engine's chunks (the driver's live on chunks and routers)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for c in eng.module for m in c.modules())


def _to_every_rank(obj, ctx):
    """Broadcast the last pipeline stage's ``obj`` (where verl collects outputs) to every rank."""
    import torch

    payload = [obj if ctx.is_last_stage else None]
    torch.distributed.broadcast_object_list(payload, src=ctx.world_size - 1)
    return payload[0]


def _order(eng) -> list[int]:
    return [s for c, samples, _ in eng.fed if c == 0 for s in samples]


def _log_probs(out) -> list:
    return [t.clone() for t in out["model_output"]["log_probs"].unbind()]


# ---------------------------------------------------------------------------------- scenarios
@contextlib.contextmanager
def _counting_adapter_calls():
    """Counts the adapter's per-micro-batch decoding and packing calls (verl's routes viewed,
    the THD micro-batch built, verl's ``preprocess_thd_engine`` metadata), each still run."""
    from unittest import mock

    from r3bridge.adapters.verl import engine_pass, hooks

    counted: dict[str, int] = {}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counted[name] = counted.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper
    with mock.patch.object(hooks, "handed_routes", counting("handed_routes", hooks.handed_routes)), \
            mock.patch.object(hooks, "preprocess_thd_engine",
                              counting("preprocess_thd_engine", hooks.preprocess_thd_engine)), \
            mock.patch.object(engine_pass, "thd_micro_batch", counting("thd_micro_batch", engine_pass.thd_micro_batch)):
        yield counted


def _r3(ctx) -> dict:
    """R3: compute_log_prob and the update replay the rollout routes wherever verl put each sample."""
    from _verl_runner import INDEX_KEY

    from r3bridge.adapters.verl.codec import SAMPLE_KEY

    rollout, eng, td = _setup(ctx, "R3")
    expected = rollout.expected()
    res = {}
    for phase, fo, mt in (("compute_log_prob", True, MAX_TOKENS[0]), ("update", False, MAX_TOKENS[1])):
        with _counting_adapter_calls() as counted:
            out, probe = _run(eng, td, forward_only=fo, max_tokens=mt)
        res[f"{phase}_adapter_calls"] = dict(counted)
        errors, checked = _dispatch_errors(ctx, eng, probe, expected)
        result = eng.r3.runner.results[-1]
        res[phase] = dict(errors=errors, checked=checked, order=_order(eng), calls=len(probe.calls),
                          routers=len(probe.routers),
                          action=result.action.value, phase=result.phase.value, metrics=dict(result.metrics),
                          logged=out.get("metrics") if out else None,
                          micro_batches=len([f for f in eng.fed if f[0] == 0]))
    res["sample_key_left"] = SAMPLE_KEY in td.keys()
    res["index_key"] = INDEX_KEY in td.keys()
    return res


def _r2(ctx) -> dict:
    """R2: compute_log_prob records what the routers chose, verl gets it per sample (nested, in
    the batch's order), the update re-partitions the batch and replays it."""
    import torch

    from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, VerlCodec

    rollout, eng, td = _setup(ctx, "R2")
    td.pop(ROUTES_KEY)                                      # R2's rollout returns no routes
    rec_out, rec_probe = _run(eng, td, forward_only=True, max_tokens=MAX_TOKENS[0])
    rec_order, native = _order(eng), _dispatched(eng, rec_probe)
    rec_result = eng.r3.runner.results[-1]
    res = dict(rec_action=rec_result.action.value, rec_order=rec_order, sample_key_left=SAMPLE_KEY in td.keys())
    routes = _to_every_rank(rec_out["model_output"][ROUTES_KEY] if rec_out else None, ctx)
    rec_logp = _log_probs(rec_out) if rec_out else None
    res.update(nested=bool(routes.is_nested), dtype=str(routes.dtype), num=len(routes.unbind()),
               rec_logged=rec_out.get("metrics") if rec_out else None)
    # the recording, decoded as the update will read it, against what this rank's routers chose
    codec = VerlCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                      num_hidden_layers=rollout.num_layers)
    td[ROUTES_KEY] = routes                                 # verl's trainer: the output goes into the batch
    recorded = codec.to_replay_batch(td, route_kind="recorded")
    rec_err, rec_rows = [], 0
    for (s, lid), chose in sorted(native.items()):
        r, v = recorded.sequence(s)
        li = recorded.layer_ids.index(lid)
        n = len(rollout.tokens[s])
        if r.shape[0] != n or not bool(v.all()):
            rec_err.append(f"sample {s}: {r.shape[0]} recorded rows ({int(v.sum())} valid) for {n} tokens")
        elif not torch.equal(r[:, li].long().sort(1).values, chose.sort(1).values):
            rec_err.append(f"sample {s} layer {lid}: recorded routes differ from the routers' choice")
        rec_rows += n
    res.update(rec_errors=rec_err, rec_rows=rec_rows)
    upd_out, upd_probe = _run(eng, td, forward_only=False, max_tokens=MAX_TOKENS[1])
    errors, checked = _dispatch_errors(ctx, eng, upd_probe, recorded)
    result = eng.r3.runner.results[-1]
    res.update(upd_errors=errors, upd_checked=checked, upd_order=_order(eng), upd_action=result.action.value,
               upd_metrics=dict(result.metrics), upd_logged=upd_out.get("metrics") if upd_out else None)
    if upd_out:
        res["max_logprob_diff"] = max(float((a - b).abs().max()) for a, b in zip(rec_logp, _log_probs(upd_out)))
    return res


def _mismatch(ctx) -> dict:
    """Trainer-vs-rollout log-prob mismatch metrics, padded and TransferQueue-nested fields,
    on the last stage; the first stage's verl output is empty while its driver still ran."""
    import torch
    from verl.workers.utils.padding import no_padding_2_padding

    from r3bridge.metrics import logprob_mismatch

    _, eng, td = _setup(ctx, "R3")
    out, _ = _run(eng, td, forward_only=True)
    first = _to_every_rank(no_padding_2_padding(out["model_output"]["log_probs"], td) if out else None, ctx)
    mask = td["response_mask"]
    rollout = first + 0.05 * mask                           # the rollout engine's, off by a known amount
    td["rollout_log_probs"] = rollout
    res: dict = {"first_stage_output": None if ctx.is_last_stage else out, "passes": []}
    for nested in (False, True):
        if nested:                                          # TransferQueue mode keeps responses nested
            lens = mask.sum(1).tolist()
            for key in ("rollout_log_probs", "response_mask"):
                dense = td[key]
                td[key] = torch.nested.as_nested_tensor([dense[i, :n] for i, n in enumerate(lens)],
                                                        layout=torch.jagged)
        lp_out, _ = _run(eng, td, forward_only=True)
        lp_driver = dict(eng.r3.runner.results[-1].metrics)
        upd_out, _ = _run(eng, td, forward_only=False)
        p = {"driver": lp_driver, "logp_output": lp_out, "upd_output": upd_out}
        if upd_out:
            want = {}
            for tag, o in (("old_log_prob", lp_out), ("update", upd_out)):
                train = no_padding_2_padding(o["model_output"]["log_probs"], td).float()
                want.update(logprob_mismatch(train, rollout.float(), mask.bool(), exclude_last=False,
                                             prefix=f"r3bridge/{tag}/"))
            p.update(want=want, logged=upd_out["metrics"], logp_logged=lp_out.get("metrics"))
        res["passes"].append(p)
        td["response_mask"] = mask
    return res


def _reference(ctx) -> dict:
    """verl's reference engine and the LoRA ``disable_adapter`` pass route natively: same
    choices as chunks no driver was ever attached to; nothing installed, nothing recorded."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY

    _, base, td = _setup(ctx, "off")
    _, native = _run(base, td, forward_only=True)
    maps = [c.routing_map for c in native.calls]
    res: dict = {"off_replayer": base.r3.replayer is None}

    def same_as_native(probe) -> bool:
        return len(probe.calls) == len(maps) and all(torch.equal(c.routing_map, m) for c, m in zip(probe.calls, maps))

    _, ref, _ = _setup(ctx, "R3", reference=True)
    out, probe = _run(ref, td, forward_only=True)
    res["ref"] = dict(replayer=ref.r3.replayer is None, native=same_as_native(probe), results=len(ref.r3.runner.results),
                      keys=sorted(out["model_output"]), metrics=sorted(out["metrics"]))
    for mode in ("R3", "R2"):
        _, eng, data = _setup(ctx, mode)
        if mode == "R2":
            data.pop(ROUTES_KEY)                            # a reference pass needs no routes either
        # the LoRA wrapper verl's disable_adapter delegates to: the harness model has no adapter
        eng.peft_cls = SimpleNamespace(disable_adapter=lambda module: contextlib.nullcontext())
        with eng.disable_adapter():
            out, probe = _run(eng, data, forward_only=True)
        res[mode] = dict(native=same_as_native(probe), results=len(eng.r3.runner.results),
                         active=eng.r3.replayer.active_pass is not None, keys=sorted(out["model_output"]),
                         metrics=sorted(out["metrics"]), sample_key=SAMPLE_KEY in data.keys(),
                         unmanaged=eng.r3.replayer.unmanaged_calls, calls=len(probe.calls))
        # outside disable_adapter the same engine replays again (R3) or records (R2)
        out, probe = _run(eng, data, forward_only=True)
        res[mode].update(after=eng.r3.runner.results[-1].action.value, after_native=same_as_native(probe))
    return res


def _config_errors(ctx) -> dict:
    """A batch without the routes the plan needs, or with routes an R2 recording would collide
    with: ConfigError before any router runs, engine state clean."""
    from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY
    from r3bridge.errors import ConfigError

    res = {}
    for name, mode, with_routes, fo in (("r3_no_routes", "R3", False, True), ("r2_update_no_routes", "R2", False, False),
                                        ("r2_record_with_routes", "R2", True, True)):
        _, eng, td = _setup(ctx, mode)
        if not with_routes:
            td.pop(ROUTES_KEY)
        try:
            _run(eng, td, forward_only=fo)
            err = None
        except ConfigError as e:
            err = str(e)
        res[name] = dict(error=err, fed=len(eng.fed), active=eng.r3.replayer.active_pass is not None,
                         step=eng._r3_pass is not None, sample_key=SAMPLE_KEY in td.keys())
    return res


def _schedule_failure(ctx) -> dict:
    """A schedule that raises after its first micro-batch ran (the second installed, not yet
    forwarded) leaves no hook, no open step, no held metrics; the engine then works."""
    from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY

    res = {}
    for mode in ("R2", "R3"):
        rollout, eng, td = _setup(ctx, mode)
        if mode == "R2":
            td.pop(ROUTES_KEY)
        inner, calls = eng.inner, []
        hooks_before = _hook_count(eng)

        def failing(batch_iter, model, inner=inner, calls=calls):
            calls.append(model)
            if len(calls) == 2:
                raise RuntimeError("schedule failed")
            return inner(batch_iter, model)
        eng.inner = failing
        try:
            _run(eng, td, forward_only=True)
            err = None
        except RuntimeError as e:
            err = str(e)
        eng.inner = inner
        hooks = _hook_count(eng) - hooks_before
        r = dict(error=err, steps_run=len(calls), hooks=hooks, active=eng.r3.replayer.active_pass is not None,
                 step=eng._r3_pass is not None, sample_key=SAMPLE_KEY in td.keys(), results=len(eng.r3.runner.results))
        out, probe = _run(eng, td, forward_only=True)
        r["after"] = eng.r3.runner.results[-1].action.value
        if mode == "R2":
            r["recorded"] = len(out["model_output"][ROUTES_KEY].unbind())
        else:
            r["after_errors"], r["after_checked"] = _dispatch_errors(ctx, eng, probe, rollout.expected())
            upd, _ = _run(eng, td, forward_only=False)
            # only the clean compute_log_prob's metrics were held for this update
            r["upd_logged"] = upd["metrics"]
        res[mode] = r
    return res


def _router_log_ratio(ctx) -> dict:
    """R3 with rollout routing weights and ``router_log_ratio`` on: the loss of every micro-batch
    finds ``router_log_ratio`` in its TensorDict, equal per token to the trainer's gate weights
    (the routers' own output probs, read by the RoutingProbe) of the replayed experts against the
    rollout's weights, summed over the MoE layers; without weights the pass is refused."""
    import torch

    from r3bridge.adapters.verl.codec import ROUTES_KEY, WEIGHTS_KEY, VerlCodec
    from r3bridge.errors import ConfigError
    from r3bridge.parallel.sharding import shard

    rollout, eng, td = _setup(ctx, "R3", router_log_ratio=True)
    routes = td[ROUTES_KEY]
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(routes.values().shape, generator=g) * 0.9 + 0.05
    td[WEIGHTS_KEY] = torch.nested.nested_tensor_from_jagged(weights, offsets=routes.offsets())
    out, probe = _run(eng, td, forward_only=True)
    batch = VerlCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                      num_hidden_layers=rollout.num_layers).to_replay_batch(td)
    fed = _fed_by_chunk(eng)[0]
    expected = [None] * len(fed)
    seen: dict[int, int] = {}
    for call in probe.calls:
        m = seen[call.layer_id] = seen.get(call.layer_id, -1) + 1
        samples, packed = fed[m]
        tg = shard(batch.select(samples), eng.r3.replayer.layout, packed.seq_lens, layer_ids=[call.layer_id],
                   cu_seqlens_padded=packed.cu_seqlens_padded)
        idx, w = tg.indices[call.layer_id], tg.weights[call.layer_id]
        term = (call.probs.double().gather(1, idx).log() - w.double().log()).sum(-1)
        term = torch.where(tg.valid, term, 0.0)
        expected[m] = term if expected[m] is None else expected[m] + term
    errors, tokens = [], 0
    for m, ((samples, packed), handed) in enumerate(zip(fed, eng.handed_log_ratio)):
        if handed is None:
            errors.append(f"micro-batch {m}: the loss found no router_log_ratio")
            continue
        for s, got, off, n in zip(samples, handed.unbind(), packed.cu_seqlens_padded.tolist(), packed.seq_lens):
            want = expected[m][off:off + n]
            if got.shape != want.shape or not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5):
                errors.append(f"micro-batch {m} sample {s}: handed {got.tolist()} != {want.tolist()}")
            tokens += n
    res = dict(errors=errors, tokens=tokens, nonzero=bool(any(bool(e.abs().sum() > 0) for e in expected)),
               metrics=dict(eng.r3.runner.results[-1].metrics))
    td.pop(WEIGHTS_KEY)
    try:
        _run(eng, td, forward_only=True)
        res["no_weights"] = None
    except ConfigError as e:
        res["no_weights"] = str(e)
    return res


def _provenance(ctx) -> dict:
    """The retraction case: sample 3's server call was preempted once (vLLM re-prefilled it, so its
    routes are the re-prefill's, epoch 1) while its first tokens' log-probs came from the first
    pass. Provenance comes from verl's own ``TokenOutput`` (``global_steps``, ``num_preempted``)
    through the agent loop's ``call_provenance``, into the batch as verl carries extra fields."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.rollout.replica import TokenOutput

    from r3bridge.adapters.verl.codec import SAMPLE_KEY
    from r3bridge.adapters.verl.rollout import call_provenance
    from r3bridge.batch.provenance import LOGPROB_PROVENANCE_KEY, ROUTE_PROVENANCE_KEY
    from r3bridge.errors import ProvenanceError

    res = {}
    for name, check, preempted in (("count", "count", 1), ("refuse", "refuse", 1), ("matching", "refuse", 0)):
        _, eng, td = _setup(ctx, "R3", provenance_check=check)
        pairs = [call_provenance([TokenOutput(token_ids=[1], num_preempted=preempted if i == 3 else 0,
                                              extra_fields={"global_steps": 5, "min_global_steps": 5})],
                                 engine="vllm", request_id=f"req-{i}") for i in range(BATCH)]
        tu.assign_non_tensor_stack(td, ROUTE_PROVENANCE_KEY, [r for r, _ in pairs])
        tu.assign_non_tensor_stack(td, LOGPROB_PROVENANCE_KEY, [lp for _, lp in pairs])
        r = {}
        for phase, fo in (("compute_log_prob", True), ("update", False)):
            try:
                out, _ = _run(eng, td, forward_only=fo)
                r[phase] = dict(error=None, metrics=dict(eng.r3.runner.results[-1].metrics),
                                logged=sorted((out or {}).get("metrics", {})))
            except ProvenanceError as e:
                r[phase] = dict(error=str(e), fed=len(eng.fed), active=eng.r3.replayer.active_pass is not None,
                                step=eng._r3_pass is not None, sample_key=SAMPLE_KEY in td.keys())
        res[name] = r
    return res


HANDLE_STEP = 7


def _by_reference(ctx, eng, td, *, damage=None, sample_step=HANDLE_STEP) -> dict:
    """Routes by reference in ``td``: each sample's routes (verl's transport, as the agent loop
    finished them) written once by the adapter's :class:`RouteWriter` on rank 0 into a folder all
    ranks see; the batch keeps only the handle in each sample's ``extra_fields`` (and verl's
    per-sample ``uid`` / ``global_steps``). ``damage(path)``: done to sample 3's file after writing;
    ``sample_step``: sample 3's ``global_steps``."""
    import os
    import tempfile

    import torch
    from verl.utils import tensordict_utils as tu

    from r3bridge.adapters.verl.codec import ROUTES_KEY
    from r3bridge.adapters.verl.route_handles import HANDLE_KEY, RouteWriter
    from r3bridge.handles import FileRoutes, RouteHandle

    cfg, hs = eng.r3.config, eng._r3_handles
    texts = None
    if ctx.rank == 0:
        writer = RouteWriter(cfg, moe_layer_ids=eng.r3.model.moe_layer_ids, num_hidden_layers=eng.r3.model.num_layers,
                             num_experts=eng.r3.model.num_experts, run_id=hs.run_id)
        texts = [writer.put(r.numpy(), step=HANDLE_STEP, sample=f"uid{s}_0_w") for s, r in enumerate(td[ROUTES_KEY].unbind())]
        if damage is not None:
            damage(FileRoutes(cfg.route_store).path(RouteHandle.from_json(texts[3]).key))
    if ctx.world_size > 1:
        box = [texts]
        torch.distributed.broadcast_object_list(box, src=0)
        texts = box[0]
    td.pop(ROUTES_KEY)
    tu.assign_non_tensor_stack(td, "extra_fields", [{HANDLE_KEY: t} for t in texts])
    tu.assign_non_tensor_stack(td, "uid", [f"uid{s}" for s in range(len(texts))])
    steps = [HANDLE_STEP] * len(texts)
    steps[3] = sample_step                                  # sample 3's prompt drawn for this step
    tu.assign_non_tensor_stack(td, "global_steps", steps)
    run_dir = os.path.join(cfg.route_store, hs.run_id)
    return {"run_dir": run_dir, "bytes": sum(len(t) for t in texts), "tmp": tempfile.gettempdir()}


def _handles_setup(ctx, store: str, mode: str = "R3"):
    import os

    from r3bridge.adapters.verl.route_handles import RUN_ENV

    os.environ[RUN_ENV] = "enginetest"
    return _setup(ctx, mode, route_transport="handles", route_store=store)


def _shared_dir(ctx, name: str) -> str:
    import tempfile

    import torch

    box = [tempfile.mkdtemp(prefix=f"r3h-{name}-") if ctx.rank == 0 else None]
    if ctx.world_size > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _r3_handles(ctx) -> dict:
    """R3 with routes by reference: the same replay as inline (every router call, the metrics),
    and the step's files released after its last update pass (verl's ``update_lr_scheduler``)."""
    import os

    from verl.utils import tensordict_utils as tu

    rollout, eng, td = _handles_setup(ctx, _shared_dir(ctx, "r3"))
    info = _by_reference(ctx, eng, td)
    expected = rollout.expected()
    res = {"handle_bytes": info["bytes"]}
    for phase, fo, mt in (("compute_log_prob", True, MAX_TOKENS[0]), ("update", False, MAX_TOKENS[1])):
        if not fo:
            tu.assign_non_tensor(td, update_lr_scheduler=True)         # the step's last update mini-batch
        files_before = sum(len(f) for _, _, f in os.walk(info["run_dir"]))
        out, probe = _run(eng, td, forward_only=fo, max_tokens=mt)
        errors, checked = _dispatch_errors(ctx, eng, probe, expected)
        res[phase] = dict(errors=errors, checked=checked, files_before=files_before,
                          metrics=dict(eng.r3.runner.results[-1].metrics), logged=out.get("metrics") if out else None)
    import torch
    torch.distributed.barrier()
    res["files_after"] = sum(len(f) for _, _, f in os.walk(info["run_dir"]))
    return res


def _r2_handles(ctx) -> dict:
    """R2 with routes by reference: compute_log_prob stores its recording once (the last stage,
    where verl collects outputs) and hands verl only handles; the update, re-partitioned by verl,
    dispatches for every (sample, layer) exactly what compute_log_prob chose."""
    import os

    import torch
    from verl.utils import tensordict_utils as tu

    from r3bridge.adapters.verl.codec import ROUTES_KEY
    from r3bridge.adapters.verl.route_handles import RECORDED_HANDLE_KEY

    _, eng, td = _handles_setup(ctx, _shared_dir(ctx, "r2"), mode="R2")
    td.pop(ROUTES_KEY)                                      # R2's rollout returns no routes
    n = len(td)
    tu.assign_non_tensor_stack(td, "uid", [f"uid{s}" for s in range(n)])
    tu.assign_non_tensor_stack(td, "global_steps", [HANDLE_STEP] * n)
    rec_out, rec_probe = _run(eng, td, forward_only=True, max_tokens=MAX_TOKENS[0])
    chose = _dispatched(eng, rec_probe)
    texts = _to_every_rank(rec_out["model_output"][RECORDED_HANDLE_KEY] if rec_out else None, ctx)
    res = dict(routes_out=bool(rec_out) and ROUTES_KEY in rec_out["model_output"], handles=len(texts),
               handle_bytes=sum(len(t) for t in texts))
    tu.assign_non_tensor_stack(td, RECORDED_HANDLE_KEY, list(texts))     # verl's trainer: the output into the batch
    tu.assign_non_tensor(td, update_lr_scheduler=True)
    run_dir = os.path.join(eng.r3.config.route_store, eng._r3_handles.run_id)
    res["files_before"] = sum(len(f) for _, _, f in os.walk(run_dir))
    _, upd_probe = _run(eng, td, forward_only=False, max_tokens=MAX_TOKENS[1])
    got = _dispatched(eng, upd_probe)
    res["differ"] = [key for key in chose if not torch.equal(chose[key].sort(1).values, got[key].sort(1).values)]
    res["compared"] = len(chose)
    res["upd_metrics"] = dict(eng.r3.runner.results[-1].metrics)
    torch.distributed.barrier()
    res["files_after"] = sum(len(f) for _, _, f in os.walk(run_dir))
    return res


def _handles_fail_closed(ctx) -> dict:
    """A missing, truncated or altered route object, or a handle of another step: refused before
    any router replays it, naming verl's sample (its uid) and the handle."""
    import os

    from r3bridge.handles import RouteHandleError

    def truncate(path):
        os.truncate(path, os.path.getsize(path) - 7)

    def alter(path):
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)                 # the last stored row of the last layer
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x1]))

    res = {}
    for name, damage, step in (("missing", os.unlink, HANDLE_STEP), ("truncated", truncate, HANDLE_STEP),
                               ("altered", alter, HANDLE_STEP), ("other_step", None, HANDLE_STEP + 1)):
        _, eng, td = _handles_setup(ctx, _shared_dir(ctx, name))
        _by_reference(ctx, eng, td, damage=damage, sample_step=step)
        try:
            _run(eng, td, forward_only=True)
            res[name] = None
        except RouteHandleError as e:
            res[name] = dict(error=str(e), active=eng.r3.replayer.active_pass is not None)
    # verl's own agent loops under handles: the bytes inline, never read silently
    from r3bridge.errors import ConfigError

    _, eng, td = _handles_setup(ctx, _shared_dir(ctx, "inline"))
    try:
        _run(eng, td, forward_only=True)
        res["inline"] = None
    except ConfigError as e:
        res["inline"] = str(e)
    return res


ONE_RANK = {"reference": _reference, "config_errors": _config_errors, "schedule_failure": _schedule_failure,
            "router_log_ratio": _router_log_ratio, "provenance": _provenance, "handles_fail_closed": _handles_fail_closed}
PP2_VPP2 = {"r3": _r3, "r2": _r2, "mismatch": _mismatch, "r3_handles": _r3_handles, "r2_handles": _r2_handles}


LAYOUTS = [Layout(pp=2, vpp=2), Layout()]
SCENARIOS = [PP2_VPP2, ONE_RANK]     # per layout


def _scenarios(ctx) -> dict:
    """This layout's scenarios' results. A scenario that raises ends the run at once (the spawn
    kills the other rank, which may be waiting on it in the pipeline, and reports the traceback)."""
    return {name: fn(ctx) for name, fn in SCENARIOS[ctx.layout_index].items()}


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    """One pair of processes for both layouts (process start-up dominates this file's time):
    ``runs[layout][rank]``. Under ``Layout()`` the two ranks are data-parallel replicas that
    run the one-rank scenarios independently (nothing in them communicates)."""
    return spawn_layouts(_scenarios, world_size=2, layouts=LAYOUTS, timeout=300)


@pytest.fixture(scope="module")
def pp2_vpp2(runs) -> list[dict]:
    """Per rank (rank 0: first stage, rank 1: last stage)."""
    return runs[0]


@pytest.fixture(scope="module")
def one_rank(runs) -> dict:
    return runs[1][0]


def _ranks(per_rank: list[dict], name: str) -> list[dict]:
    return [r[name] for r in per_rank]


# ---------------------------------------------------------------------------------- tests
def test_r3_replays_rollout_routes_in_log_prob_and_update(pp2_vpp2):
    first, last = _ranks(pp2_vpp2, "r3")
    for rank in (first, last):
        for phase, want in (("compute_log_prob", "compute_log_prob"), ("update", "update")):
            r = rank[phase]
            assert (r["action"], r["phase"]) == ("replay", want)
            # every router call of both chunks dispatched the rollout's routes of the samples
            # verl packed into that micro-batch
            assert r["errors"] == [] and r["checked"] > 0, r["errors"]
            assert r["calls"] == r["routers"] * r["micro_batches"] > 0
            assert r["metrics"]["r3bridge/coverage"] > 0.8
            # under VPP each micro-batch is decoded and packed once, by its first chunk's install,
            # not once per chunk (both chunks of this rank installed every micro-batch)
            assert rank[f"{phase}_adapter_calls"] == dict.fromkeys(
                ("handed_routes", "preprocess_thd_engine", "thd_micro_batch"), r["micro_batches"]), rank
        # verl's dynamic batching re-ordered the samples, differently in the two passes
        orders = [rank[p]["order"] for p in ("compute_log_prob", "update")]
        assert all(sorted(o) == list(range(BATCH)) for o in orders) and orders[0] != list(range(BATCH))
        assert orders[0] != orders[1]
        assert not rank["sample_key_left"] and rank["index_key"]
    assert first["compute_log_prob"]["logged"] is None       # verl returns outputs from the last stage only
    assert last["compute_log_prob"]["logged"] == {}          # compute_log_prob's metrics held for the update
    logged, clp = last["update"]["logged"], last["compute_log_prob"]["metrics"]
    assert logged["r3bridge/old_log_prob/coverage"] == [pytest.approx(clp["r3bridge/coverage"])]
    assert logged["r3bridge/update/coverage"] == [pytest.approx(last["update"]["metrics"]["r3bridge/coverage"])]
    assert logged["r3bridge/old_log_prob/agreement/mean"] == [pytest.approx(clp["r3bridge/agreement/mean"])]
    # the driver's metrics are reduced over the pipeline: both stages report the same numbers
    assert first["update"]["metrics"] == pytest.approx(last["update"]["metrics"])


def test_r3_by_reference_replays_as_inline_and_releases_the_step(pp2_vpp2):
    """route_transport: handles: each sample's routes stored once, the batch carries handles, each
    stage reads its rows of its layers: the same dispatch and the same counters as inline; after
    the step's last update pass the step's route files are gone."""
    inline = _ranks(pp2_vpp2, "r3")
    for rank, ref in zip(_ranks(pp2_vpp2, "r3_handles"), inline):
        for phase in ("compute_log_prob", "update"):
            r = rank[phase]
            assert r["errors"] == [] and r["checked"] == ref[phase]["checked"] > 0, r["errors"]
            assert r["metrics"] == pytest.approx(ref[phase]["metrics"]), (r["metrics"], ref[phase]["metrics"])
            assert r["logged"] == ref[phase]["logged"]
            assert r["files_before"] == BATCH
        assert rank["files_after"] == 0
        assert rank["handle_bytes"] < 600 * BATCH         # what verl's TransferQueue moves per sample now


def test_r2_records_by_reference_and_the_update_replays_it(pp2_vpp2):
    first, last = _ranks(pp2_vpp2, "r2_handles")
    # only handles go back to verl (from the last stage), one per sample, stored once
    assert last["handles"] == BATCH and not last["routes_out"] and last["handle_bytes"] < 600 * BATCH
    for r in (first, last):
        assert r["differ"] == [] and r["compared"] > 0, r["differ"]
        assert r["upd_metrics"]["r3bridge/agreement/mean"] == pytest.approx(1.0)
        assert r["files_before"] == BATCH and r["files_after"] == 0


def test_route_handles_fail_closed_naming_verls_sample(one_rank):
    r = one_rank["handles_fail_closed"]
    for name, says in (("missing", "no route file"), ("truncated", "truncated"), ("altered", "changed"),
                       ("other_step", "step 8")):
        assert r[name] is not None, name
        err = r[name]["error"]
        assert "sample 'uid3_0_w'" in err and says in err, (name, err)
        assert not r[name]["active"]                       # nothing half-applied: the pass was torn down
    assert "(route handle files:enginetest/7/uid3_0_w" in r["missing"]["error"]
    assert "routed_experts inline and no route handles: its agent loops are verl's own" in r["inline"]


def test_r2_records_then_replays_its_own_routes_per_sample(pp2_vpp2):
    ranks = _ranks(pp2_vpp2, "r2")
    for r in ranks:
        assert (r["rec_action"], r["upd_action"]) == ("record", "replay")
        # verl gets the recording per sample, nested int16, in the batch's sample order
        assert r["nested"] and r["dtype"] == "torch.int16" and r["num"] == BATCH
        # and it is what this stage's routers chose for each sample in compute_log_prob
        assert r["rec_errors"] == [] and r["rec_rows"] > 0, r["rec_errors"]
        # the update, re-partitioned by verl, dispatched each sample's recorded routes
        assert r["upd_errors"] == [] and r["upd_checked"] > 0, r["upd_errors"]
        assert r["rec_order"] != list(range(BATCH)) and r["upd_order"] != r["rec_order"]
        assert not r["sample_key_left"]
        assert r["upd_metrics"]["r3bridge/agreement/mean"] == pytest.approx(1.0)
    last = ranks[1]
    assert last["max_logprob_diff"] < 1e-5                   # replaying the recording reproduces its log-probs
    m = last["upd_logged"]
    assert m["r3bridge/update/agreement/mean"] == [pytest.approx(1.0)]
    assert m["r3bridge/update/coverage"] == [pytest.approx(last["upd_metrics"]["r3bridge/coverage"])]
    assert not any(k.startswith("r3bridge/old_log_prob/agreement") for k in m)   # RECORD has no agreement


def test_reference_passes_never_replay(one_rank):
    r = one_rank["reference"]
    assert r["off_replayer"]
    ref = r["ref"]
    # verl's reference engine gets no driver; its routers choose what unattached chunks choose
    assert ref["replayer"] and ref["native"] and ref["results"] == 0
    assert "routed_experts" not in ref["keys"] and not any(k.startswith("r3bridge/") for k in ref["metrics"])
    for mode, after in (("R3", "replay"), ("R2", "record")):
        m = r[mode]
        # the LoRA reference pass inside the actor: native routing, no step, no recording
        assert m["native"] and m["results"] == 0 and not m["active"] and not m["sample_key"], (mode, m)
        assert "routed_experts" not in m["keys"] and not any(k.startswith("r3bridge/") for k in m["metrics"])
        assert m["unmanaged"] == m["calls"] > 0          # the attached routers saw the pass, outside any step
        assert m["after"] == after
    assert not r["R3"]["after_native"]                   # the R3 replay really changes the routing


def test_missing_or_conflicting_routes_are_config_errors(one_rank):
    r = one_rank["config_errors"]
    for name, words in (("r3_no_routes", ["replay_mode=R3", "'routed_experts'",
                                          "actor_rollout_ref.rollout.enable_rollout_routing_replay"]),
                        ("r2_update_no_routes", ["replay_mode=R2", "'routed_experts'",
                                                 "algorithm.rollout_correction.bypass_mode=False"]),
                        ("r2_record_with_routes", ["already carries 'routed_experts'",
                                                   "actor_rollout_ref.rollout.enable_rollout_routing_replay=False"])):
        c = r[name]
        assert c["error"] is not None, name
        for w in words:
            assert w in c["error"], (name, c["error"])
        # raised before verl's schedule: no forward step, no open step, no sample index left
        assert c["fed"] == 0 and not c["active"] and not c["step"] and not c["sample_key"], (name, c)


def test_mismatch_metrics_and_other_stages(pp2_vpp2):
    first, last = _ranks(pp2_vpp2, "mismatch")
    assert first["first_stage_output"] == {}                 # not the last stage: verl's output is empty
    for p_first, p_last in zip(first["passes"], last["passes"]):
        assert p_first["logp_output"] == {} and p_first["upd_output"] == {}
        # both stages' drivers ran the pass and agree on its metrics
        assert p_first["driver"] == pytest.approx(p_last["driver"]) and p_first["driver"]["r3bridge/coverage"] > 0.8
    for p in last["passes"]:                                 # padded, then TransferQueue-nested fields
        assert p["logp_logged"] == {}
        for k, v in p["want"].items():
            assert p["logged"][k] == [pytest.approx(v, abs=1e-6)], k
        assert p["want"]["r3bridge/old_log_prob/mismatch/k3_kl"] > 0
        assert any(k.startswith("r3bridge/update/mismatch/") for k in p["want"])
        # every compute_log_prob since the last update is logged with it, this pass's last
        assert p["logged"]["r3bridge/old_log_prob/coverage"][-1] == pytest.approx(p["driver"]["r3bridge/coverage"])


def test_schedule_failure_frees_state(one_rank):
    r = one_rank["schedule_failure"]
    for mode, after in (("R2", "record"), ("R3", "replay")):
        m = r[mode]
        assert m["error"] == "schedule failed" and m["steps_run"] == 2, (mode, m)
        assert m["hooks"] == 0 and not m["active"] and not m["step"] and not m["sample_key"], (mode, m)
        assert m["results"] == 0, (mode, m)                 # no phase result from the failed pass
        assert m["after"] == after
    assert r["R2"]["recorded"] == BATCH
    assert r["R3"]["after_errors"] == [] and r["R3"]["after_checked"] > 0
    logged = r["R3"]["upd_logged"]
    assert len(logged["r3bridge/old_log_prob/coverage"]) == 1     # the failed pass held nothing


def test_router_log_ratio_reaches_the_loss_per_token(one_rank):
    r = one_rank["router_log_ratio"]
    assert r["errors"] == [] and r["tokens"] > 0 and r["nonzero"], r["errors"][:3]
    assert "r3bridge/replay/router_log_ratio_mean" in r["metrics"]
    assert r["no_weights"] is not None and "routing weights" in r["no_weights"]


def test_reprefilled_routes_are_counted_or_refused_by_provenance(one_rank):
    """Retraction / preemption case (miles #3277, vLLM #39917): count mode replays and counts the
    one sample whose routes came from a re-prefill, refuse mode stops before anything is installed
    naming that sample and both provenances, matching provenance passes with 0 mismatches."""
    res = one_rank["provenance"]
    for phase in ("compute_log_prob", "update"):
        counted = res["count"][phase]
        assert counted["error"] is None
        assert counted["metrics"]["r3bridge/provenance/mismatched_samples"] == 1.0
        assert counted["metrics"]["r3bridge/provenance/checked_samples"] == BATCH
        assert counted["metrics"]["r3bridge/provenance/unchecked_samples"] == 0.0
        matching = res["matching"][phase]
        assert matching["error"] is None and matching["metrics"]["r3bridge/provenance/mismatched_samples"] == 0.0
        refused = res["refuse"][phase]
        assert "batch index 3: " in refused["error"] and "epoch differ" in refused["error"], refused["error"]
        assert "request_id=req-3 weight_version=5 epoch=1" in refused["error"]
        assert "request_id=req-3 weight_version=5 epoch=0" in refused["error"]
        # nothing half-applied: no forward ran, no step or sample index left behind
        assert (refused["fed"], refused["active"], refused["step"], refused["sample_key"]) == (0, False, False, False)
    # verl logs the update's keys, compute_log_prob's carried with them (docs/metrics.md section 0)
    logged = res["count"]["update"]["logged"]
    for tag in ("old_log_prob", "update"):
        assert f"r3bridge/{tag}/provenance/mismatched_samples" in logged, logged
