"""verl 0.9.1's own workers and Megatron engine with the r3bridge adapter, on CPU gloo ranks.

Fixtures and rank functions for ``tests/adapters/test_verl_real_engine.py`` (docs/testing-harness.md,
"verl 0.9.1: what the CPU tests prove"). Everything a verl job runs is verl's code: the job config
is composed from verl's own ``ppo_megatron_trainer.yaml`` with hydra (the user's path), the
``r3bridge`` section is validated and forwarded by the adapter's ``prepare_verl_config``, the
engine class comes out of ``EngineRegistry`` (the adapter is loaded by ``import verl`` through
the ``verl.plugins`` entry point), workers are ``TrainingWorker`` / ``ActorRolloutRefWorker``,
models are built by mbridge, and batches go through verl's ``left_right_2_no_padding`` and
``tu.assign_non_tensor`` as verl's trainer sends them. The CPU / no-TE shims are only
:mod:`r3bridge.testing.harness.cpu_shim`, :mod:`testlab.verl_cpu` and
:mod:`testlab.mbridge_spec`.

Observation only: :class:`MicroBatchProbe` (forward pre-hooks on the model chunks: which
samples, in which packed order, each chunk forward got) and the harness's
:class:`~r3bridge.testing.harness.probe.RoutingProbe` (forward hooks on the routers). Expected routes
are computed here from the sample ids the chunk saw, independent of r3bridge's own packing code.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

# ------------------------------------------------------------------------------------ model
NUM_LAYERS = 4
DENSE = (0,)                      # Qwen3-MoE mlp_only_layers: layer 0 dense (first-k-dense)
MOE_LAYERS = [i for i in range(NUM_LAYERS) if i not in DENSE]
NUM_EXPERTS, TOPK, VOCAB = 8, 2, 64
ID_BASE = 3                       # first prompt token of sample s is ID_BASE + s: who is who


def write_tiny_qwen3_moe(path: str) -> str:
    """HF ``config.json`` + a word-level tokenizer of a tiny first-k-dense Qwen3-MoE (no weights:
    the harness bridge sets seeded weights, :mod:`testlab.mbridge_spec`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from testlab.mbridge_spec import tiny_qwen3_moe

    os.makedirs(path, exist_ok=True)
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    cfg = tiny_qwen3_moe(num_layers=NUM_LAYERS, dense=tuple(DENSE), num_experts=NUM_EXPERTS, topk=TOPK, vocab=VOCAB,
                         max_positions=256)
    cfg.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class JobLayout:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    recompute: bool = False        # full uniform recompute, 1 layer: routers re-run in backward

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


# megatron's local DotProductAttention refuses packed (THD) sequences ("Packed sequence is not
# supported by DotProductAttention", dot_product_attention.py:153) and verl's engine always packs
# (use_remove_padding): MoE-only layers (the harness's 'identity' attention) as in the grid.
ATTENTION = "identity"
MAX_TOKENS = 48                    # use_dynamic_bsz token budget per micro-batch


def compose_job(model_dir: str, layout: JobLayout, mode: str, extra: tuple[str, ...] = (),
                r3: Optional[dict] = None) -> Any:
    """verl's own ``ppo_megatron_trainer`` config with the overrides a user sets, plus the
    ``r3bridge`` section; validated and forwarded by the adapter (``prepare_verl_config``)."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from r3bridge.adapters.verl import prepare_verl_config

    meg = "actor_rollout_ref.actor.megatron"
    ov = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"{meg}.vanilla_mbridge=True",
        f"{meg}.tensor_model_parallel_size={layout.tp}",
        f"{meg}.sequence_parallel={layout.tp > 1}",
        f"{meg}.pipeline_model_parallel_size={layout.pp}",
        f"{meg}.virtual_pipeline_model_parallel_size={layout.vpp if layout.vpp else 'null'}",
        # the local (non-TE) attention; 'flash' is a TE / flash-attn backend
        f"{meg}.override_transformer_config.attention_backend=auto",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MAX_TOKENS}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={MAX_TOKENS}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={MAX_TOKENS}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.total_training_steps=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.rollout.enable_rollout_routing_replay={mode == 'R3'}",
    ]
    if layout.recompute:
        ov += [f"{meg}.override_transformer_config.recompute_granularity=full",
               f"{meg}.override_transformer_config.recompute_method=uniform",
               f"{meg}.override_transformer_config.recompute_num_layers=1"]
    d = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer", overrides=ov + list(extra))
    with open_dict(cfg):
        # the rollouts' rows without a route inside a sample (an untracked prefix, a canonical
        # rollout's invalid rows) reach verl's field as zero rows, which the reader refuses by
        # default as degenerate (vLLM #54730's signature): routed natively here, and counted
        cfg["r3bridge"] = {"replay_mode": mode, "degenerate_routes": "native", **(r3 or {})}
    prepare_verl_config(cfg)
    return cfg


def set_rank_env(rank: int, world_size: int) -> None:
    """What Ray gives a verl worker (``Worker.__init__`` reads these)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))


# ------------------------------------------------------------------------------------ batches
@dataclass
class Rollout:
    """One step's rollout batch (verl's padded DataProto layout) and its per-sample facts."""

    td: Any                                    # TensorDict, padded, as the trainer holds it
    tokens: list[list[int]]                    # per sample: its unpadded token ids
    routes: list[np.ndarray]                   # per sample: [n, L_all, K] engine routes (R3)
    route_valid: list[np.ndarray]              # per sample: [n] bool, False: no route (zero row)


def make_rollout(seed: int, *, n: int = 8, P: int = 10, R: int = 8, with_routes: bool = True) -> Rollout:
    """``n`` samples with left-padded prompts and right-padded responses of varied length, as
    verl's agent loop returns them; ``routed_experts`` as vLLM reports them through verl (every
    decoder layer, dense layer rows zero, rows ``[0, len - 1)``; the last token and, for one
    sample, its first two rows (untracked prefix) zero)."""
    from tensordict import TensorDict

    rng = np.random.default_rng(seed)
    S = P + R
    input_ids = torch.zeros(n, S, dtype=torch.long)
    attn = torch.zeros(n, S, dtype=torch.long)
    resp_mask = torch.zeros(n, R, dtype=torch.long)
    routes_pad = torch.zeros(n, S, NUM_LAYERS, TOPK, dtype=torch.int16)
    tokens, routes, valids = [], [], []
    for s in range(n):
        p = int(rng.integers(3, P + 1))
        r = int(rng.integers(2, R + 1))
        start = P - p
        toks = [ID_BASE + s] + rng.integers(ID_BASE + n, VOCAB, size=p + r - 1).tolist()
        input_ids[s, start:P + r] = torch.tensor(toks)
        attn[s, start:P + r] = 1
        resp_mask[s, :r] = 1
        rows = p + r
        arr = np.zeros((rows, NUM_LAYERS, TOPK), dtype=np.int16)
        valid = np.zeros(rows, dtype=bool)
        valid[: rows - 1] = True
        if s == 1:
            valid[:2] = False                           # untracked prefix rows: zero in transport
        for j in np.nonzero(valid)[0]:
            for layer in MOE_LAYERS:
                arr[j, layer] = rng.choice(NUM_EXPERTS, size=TOPK, replace=False)
        routes_pad[s, start:start + rows] = torch.from_numpy(arr)
        tokens.append(toks)
        routes.append(arr)
        valids.append(valid)
    position_ids = torch.clamp(attn.cumsum(-1) - 1, min=0)
    fields = {"input_ids": input_ids, "attention_mask": attn, "response_mask": resp_mask,
              "position_ids": position_ids, "prompts": input_ids[:, :P], "responses": input_ids[:, P:],
              "rollout_log_probs": -torch.rand(n, R) * resp_mask,
              "advantages": torch.randn(n, R) * resp_mask}
    if with_routes:
        fields["routed_experts"] = routes_pad
    return Rollout(TensorDict(fields, batch_size=[n]), tokens, routes, valids)


def padded_fields(rollout: Any) -> dict[str, torch.Tensor]:
    """A :class:`~r3bridge.testing.kit.conformance.CanonicalRollout` as verl's trainer holds it:
    left-padded prompts, right-padded responses, and verl's transport of the routes
    (``routed_experts`` ``[n, S, L_all, K]`` int16: every decoder layer, each sample's engine calls
    stitched first-seen and placed from the prompt start as verl's agent loop places them, zero
    rows where no call routed a token). ``left_right_2_no_padding`` turns it into verl's no-padding
    batch."""
    n = rollout.batch_size
    P = max(rollout.prompt_lens)
    R = max(len(t) - p for t, p in zip(rollout.tokens, rollout.prompt_lens))
    input_ids = torch.zeros(n, P + R, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    resp_mask = torch.zeros(n, R, dtype=torch.long)
    routes = torch.zeros(n, P + R, rollout.num_layers, rollout.topk, dtype=torch.int16)
    for s, (toks, p) in enumerate(zip(rollout.tokens, rollout.prompt_lens)):
        r, start = len(toks) - p, P - p
        input_ids[s, start:P + r] = torch.tensor(toks)
        attn[s, start:P + r] = 1
        resp_mask[s, :r] = 1
        acc = None                               # first-seen: each call re-sends the whole context
        for c in rollout.calls[s]:
            acc = c if acc is None else np.concatenate([acc, c[len(acc):]])
        acc = acc[:len(toks)]
        routes[s, start:start + len(acc)] = torch.from_numpy(acc.astype(np.int16))
    return {"input_ids": input_ids, "attention_mask": attn, "response_mask": resp_mask,
            "position_ids": torch.clamp(attn.cumsum(-1) - 1, min=0), "prompts": input_ids[:, :P],
            "responses": input_ids[:, P:], "routed_experts": routes}


def from_canonical(rollout: Any, *, with_routes: bool = True, seed: int = 0) -> Rollout:
    """:func:`padded_fields` plus the fields the update reads, as a :class:`Rollout` whose
    per-sample routes and valid rows are the canonical ones. The model of this module must match
    the rollout (layers, dense layers, experts, top-k, vocabulary)."""
    from tensordict import TensorDict

    if (rollout.num_layers, list(rollout.moe_layer_ids), rollout.num_experts, rollout.topk) != (
            NUM_LAYERS, MOE_LAYERS, NUM_EXPERTS, TOPK):
        raise ValueError(f"rollout model (layers {rollout.num_layers}, MoE {rollout.moe_layer_ids}, "
                         f"{rollout.num_experts} experts, top-{rollout.topk}) differs from the tiny Qwen3-MoE's")
    if max(max(t) for t in rollout.tokens) >= VOCAB or min(min(t) for t in rollout.tokens) < 1:
        raise ValueError(f"rollout tokens must lie in [1, {VOCAB}) (0 is verl's pad token)")
    fields = padded_fields(rollout)
    n, R = fields["response_mask"].shape
    P = fields["prompts"].shape[1]
    expected = rollout.expected()
    routes, valids = [], []
    for s, (toks, p) in enumerate(zip(rollout.tokens, rollout.prompt_lens)):
        start = P - p
        routes.append(fields["routed_experts"][s, start:start + len(toks)].numpy())
        v = np.zeros(len(toks), dtype=bool)
        _, ev = expected.sequence(s)
        v[expected.start_rows[s]:expected.start_rows[s] + ev.numel()] = ev.numpy()
        valids.append(v)
    g = torch.Generator().manual_seed(seed)
    resp_mask = fields["response_mask"]
    fields.update(rollout_log_probs=-torch.rand(n, R, generator=g) * resp_mask,
                  advantages=torch.randn(n, R, generator=g) * resp_mask)
    if not with_routes:
        del fields["routed_experts"]
    return Rollout(TensorDict(fields, batch_size=[n]), [list(map(int, t)) for t in rollout.tokens], routes, valids)


def sample_by_tokens(tokens: list[list[int]]) -> Any:
    """``MicroBatchProbe``'s ``sample_of`` for rollouts whose token ids do not name the sample:
    the sample whose trajectory a packed sequence holds (trailing pad ids 0 ignored)."""
    table = {tuple(t): s for s, t in enumerate(tokens)}
    if len(table) != len(tokens):
        raise ValueError("two samples have the same tokens: packed sequences cannot be told apart")

    def sample_of(ids: list[int]) -> int:
        while ids and ids[-1] == 0:
            ids = ids[:-1]
        s = table.get(tuple(ids))
        if s is None:
            raise AssertionError(f"a packed sequence {ids[:8]}... is no sample of the rollout")
        return s
    return sample_of


def old_log_prob_batch(td: Any) -> Any:
    """``RayPPOTrainer._compute_old_log_prob`` steps 1-3 (verl's own utilities)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    out = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(out, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False,
                         temperature=1.0)
    return out


def ref_log_prob_batch(td: Any) -> Any:
    """``RayPPOTrainer._compute_ref_log_prob`` steps 1-3 (separate reference worker)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    out = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(out, calculate_entropy=False, compute_loss=False, temperature=1.0)
    return out


def update_batch(td: Any, mini_batch_size: int, *, seed: int = 1) -> Any:
    """``RayPPOTrainer._update_actor`` steps 1-3: mini-batches, shuffled by verl's data loader."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    out = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(out, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini_batch_size, mini_batch_size=mini_batch_size, epochs=1, seed=seed,
                         dataloader_kwargs={"shuffle": True}, compute_loss=True, temperature=1.0)
    return out


# ------------------------------------------------------------------------------------ observation
@dataclass
class ChunkForward:
    chunk: int
    samples: list[int]             # sample ids in packed order
    lens: list[int]                # cu_seqlens_q lengths (verl may report them padded too)
    padded: list[int]              # packed (padded) lengths


class MicroBatchProbe:
    """Forward pre-hooks on the (unwrapped) model chunks: for each chunk forward, which samples
    verl packed in which order (read from the first token of each packed sequence, or by
    ``sample_of(token ids of the packed sequence)``, e.g. :func:`sample_by_tokens`)."""

    def __init__(self, chunks: list[torch.nn.Module], sample_of: Optional[Any] = None):
        self.chunks = chunks
        self.sample_of = sample_of
        self.calls: list[ChunkForward] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "MicroBatchProbe":
        for i, c in enumerate(self.chunks):
            self._handles.append(c.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, ci: int) -> Any:
        def hook(module: Any, args: Any, kwargs: dict) -> None:
            ids = kwargs.get("input_ids")
            psp = kwargs.get("packed_seq_params")
            if ids is None or psp is None:
                raise AssertionError(f"chunk {ci}: verl's forward passed no input_ids / packed_seq_params "
                                     f"(kwargs {sorted(kwargs)})")
            cu = psp.cu_seqlens_q.cpu().tolist()
            cu_pad = (psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q)
            cu_pad = cu_pad.cpu().tolist()
            lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
            padded = [b - a for a, b in zip(cu_pad[:-1], cu_pad[1:])]
            if getattr(ids, "is_nested", False):
                # later pipeline stages get verl's nested (unpacked) micro-batch, same order
                seqs = [t.cpu().tolist() for t in ids.unbind()]
            else:
                flat = ids.reshape(-1).cpu()
                seqs = [flat[a:a + n].tolist() for a, n in zip(cu_pad[:-1], lens)]
            if self.sample_of is None:
                samples = [int(t[0]) - ID_BASE for t in seqs]
            else:
                samples = [self.sample_of(t) for t in seqs]
            self.calls.append(ChunkForward(ci, samples, lens, padded))
        return hook

    def per_chunk(self) -> dict[int, list[ChunkForward]]:
        out: dict[int, list[ChunkForward]] = defaultdict(list)
        for c in self.calls:
            out[c.chunk].append(c)
        return out


def unwrapped_chunks(engine: Any) -> list[torch.nn.Module]:
    from verl.utils.megatron_utils import unwrap_model

    return [unwrap_model(m) for m in engine.module]


def attribute_router_calls(probe: Any, mb_probe: MicroBatchProbe) -> list[tuple[Any, ChunkForward, str]]:
    """Pair each router call with the chunk forward it belongs to. Per (chunk, layer), the calls
    of one kind (first pass, or recompute: grad enabled inside a no-grad-first checkpoint) come
    in the chunk's micro-batch order, in every megatron schedule."""
    fwd = mb_probe.per_chunk()
    seqs: dict[tuple[int, int, bool], list[Any]] = defaultdict(list)
    for call in probe.calls:
        if call.mtp:
            continue
        seqs[(call.chunk, call.layer_id, call.grad_enabled)].append(call)
    out = []
    for (chunk, layer, grad), calls in seqs.items():
        kind = "forward"
        if grad and (chunk, layer, False) in seqs and len(seqs[(chunk, layer, False)]) == len(fwd[chunk]):
            kind = "recompute"
        if len(calls) != len(fwd[chunk]):
            raise AssertionError(f"chunk {chunk} layer {layer} grad={grad}: {len(calls)} router calls for "
                                 f"{len(fwd[chunk])} chunk forwards")
        out += [(call, mb, kind) for call, mb in zip(calls, fwd[chunk])]
    return out


def expected_rows(mb: ChunkForward, tp: int, tp_rank: int, sp: bool) -> list[tuple[int, int]]:
    """(sample, token position) of each router row on this TP rank, -1 for padding rows.
    THD packing: each sequence padded to its packed length; SP: contiguous split over TP."""
    rows: list[tuple[int, int]] = []
    for s, n, pad in zip(mb.samples, mb.lens, mb.padded):
        rows += [(s, j) for j in range(n)] + [(-1, -1)] * (pad - n)
    if sp and tp > 1:
        k = len(rows) // tp
        rows = rows[tp_rank * k:(tp_rank + 1) * k]
    return rows


@dataclass
class PassCheck:
    """What one pass's router calls showed, summarised for the test process (picklable)."""

    phase: str
    checked_rows: int = 0                       # (row, layer) pairs compared with a target
    mismatches: list[str] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)   # router calls per kind
    samples_seen: list[int] = field(default_factory=list)
    micro_batches: list[list[int]] = field(default_factory=list)   # chunk 0's packed sample order


def check_pass(phase: str, probe: Any, mb_probe: MicroBatchProbe, targets: dict[int, np.ndarray],
               target_valid: dict[int, np.ndarray], *, tp: int, tp_rank: int, sp: bool,
               record: Optional[dict] = None) -> PassCheck:
    """Compare each router call's dispatched top-k with ``targets[sample][row, layer]`` on every
    row where ``target_valid[sample][row]``; ``record`` (R2 compute_log_prob) instead collects
    each sample's native routes: ``record[sample][row][layer] = sorted ids``."""
    res = PassCheck(phase)
    for call, mb, kind in attribute_router_calls(probe, mb_probe):
        res.kinds[kind] = res.kinds.get(kind, 0) + 1
        got = call.topk().tolist()
        rows = expected_rows(mb, tp, tp_rank, sp)
        if len(rows) != len(got):
            res.mismatches.append(f"{phase} layer {call.layer_id}: {len(got)} router rows, packed "
                                  f"micro-batch has {len(rows)} on tp rank {tp_rank}")
            continue
        for (s, j), ids in zip(rows, got):
            if s < 0:
                continue
            if record is not None:
                record.setdefault(s, {}).setdefault(j, {})[call.layer_id] = sorted(ids)
                continue
            tv = target_valid.get(s)
            if tv is None or j >= len(tv) or not tv[j]:
                continue
            want = sorted(int(x) for x in targets[s][j, call.layer_id])
            res.checked_rows += 1
            if sorted(ids) != want:
                res.mismatches.append(f"{phase} {kind} sample {s} row {j} layer {call.layer_id}: "
                                      f"dispatched {sorted(ids)}, target {want}")
    fwd = mb_probe.per_chunk()
    res.micro_batches = [c.samples for c in fwd.get(0, [])]
    res.samples_seen = sorted({s for c in fwd.get(0, []) for s in c.samples})
    return res


def recorded_to_targets(record: dict, lens: dict[int, int]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """R2: what compute_log_prob's routers chose natively, per sample, as [n, L_all, K] targets
    (valid on every row but the last, which has no route in verl's layout)."""
    targets, valid = {}, {}
    for s, rows in record.items():
        n = lens[s]
        arr = np.zeros((n, NUM_LAYERS, TOPK), dtype=np.int64)
        v = np.zeros(n, dtype=bool)
        for j, per_layer in rows.items():
            if j >= n:         # a padding row of the packed sequence (verl pads each to the TP size)
                continue
            for layer, ids in per_layer.items():
                arr[j, layer] = ids
            v[j] = j < n - 1
        targets[s], valid[s] = arr, v
    return targets, valid


def nested_routes_to_samples(nested: Any) -> list[np.ndarray]:
    """verl's ``model_output['routed_experts']`` (nested jagged [b, n_i, L_all, K]) per sample."""
    return [t.cpu().numpy() for t in nested.unbind()]


# ------------------------------------------------------------------------------------ rank functions
def _engine_state(engine: Any) -> list[str]:
    """Replay state left in the engine after a call (must be none)."""
    left = []
    if getattr(engine, "_r3_pass", None) is not None:
        left.append("engine._r3_pass")
    rep = getattr(getattr(engine, "r3", None), "replayer", None)
    if rep is not None and rep.active_pass is not None:
        left.append("replayer.active_pass")
    return left


def log_dispatch(log: Any, step: int, phase: str, probe: Any, mb_probe: MicroBatchProbe, chunks: list,
                 lens: dict[int, int]) -> None:
    """Every real row of every router call of one pass into ``log`` (a
    :class:`~testlab.dispatch_records.DispatchLog`), mapped to (sample, token) with the
    packing verl really used (the chunk forward's samples and padded ``cu_seqlens``; ``lens``:
    each sample's real token count)."""
    from megatron.core import parallel_state as ps

    from r3bridge.parallel.layout import ParallelLayout
    from testlab.dispatch_records import router_rows

    layout = ParallelLayout.from_megatron(chunks[0].config)
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    for call, mb, _ in attribute_router_calls(probe, mb_probe):
        cu = np.concatenate([[0], np.cumsum(mb.padded)]).tolist()
        sample, token = router_rows(mb.samples, [lens[s] for s in mb.samples], layout, tp_rank=tp_rank,
                                    cp_rank=cp_rank, cu_seqlens_padded=cu)
        log.add(step=step, phase=phase, grad=call.grad_enabled, layer=call.layer_id, topk=call.topk(),
                sample=sample, token=token)


def _log_prob_pass(result: dict, step: int, run: Any, lp: Any, roll: Rollout, chunks: list, engine: Any,
                   mode: str, *, tp: int, tp_rank: int, sp: bool, sample_of: Any = None, log: Any = None
                   ) -> tuple[Any, dict, dict]:
    """One compute_log_prob pass under the probes, checked; returns (output, targets, validity) the
    update must dispatch: the rollout's routes (R3) or what this pass recorded (R2). ``log``: a
    ``DispatchLog`` that gets every router row's dispatch."""
    from r3bridge.testing.harness.probe import RoutingProbe

    with RoutingProbe(chunks) as rp, MicroBatchProbe(chunks, sample_of) as mp:
        out = run(lp)
    if log is not None:
        log_dispatch(log, step, "compute_log_prob", rp, mp, chunks, {s: len(t) for s, t in enumerate(roll.tokens)})
    record: Optional[dict] = {} if mode == "R2" else None
    tg, tv = _routes_of(roll)
    result["passes"].append(check_pass(f"step{step}/compute_log_prob", rp, mp, tg, tv, tp=tp,
                                       tp_rank=tp_rank, sp=sp, record=record))
    result["state_left"] += [f"step{step}/compute_log_prob: {x}" for x in _engine_state(engine)]
    if mode == "R2":
        tg, tv = recorded_to_targets(_gather_record(record), {s: len(t) for s, t in enumerate(roll.tokens)})
    return out, tg, tv


def _routes_of(roll: Rollout) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    return dict(enumerate(roll.routes)), dict(enumerate(roll.route_valid))


def _with_old_log_probs(td: Any, lp_batch: Any, out: Any, mode: str) -> Any:
    """``RayPPOTrainer``: old log-probs (and R2's recorded routes) join the batch for the update."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td = td.clone()
    td["old_log_probs"] = no_padding_2_padding(tu.get(out, "log_probs"), lp_batch).float()
    if mode == "R2":
        td["routed_experts"] = tu.get(out, "routed_experts")
    return td


def run_training_worker(ctx: Any, model_dir: str, layout: JobLayout, mode: str, steps: int,
                        canonical: Optional[list] = None, r3: Optional[dict] = None) -> dict:
    """``TrainingWorker``: ``infer_batch`` (compute_log_prob) then ``train_mini_batch`` (the
    update), ``steps`` times, checking every router call. ``canonical``: one
    :class:`~r3bridge.testing.kit.conformance.CanonicalRollout` per step instead of this module's own
    rollouts (``steps`` is then their number); the result's ``dispatch`` holds this rank's
    :class:`~testlab.dispatch_records.DispatchRecords` of every router row."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from r3bridge.testing.harness.probe import RoutingProbe
    from testlab.dispatch_records import DispatchLog
    from testlab.verl_cpu import build_shims

    ps.destroy_model_parallel()           # verl's engine initialises model parallelism itself
    set_rank_env(ctx.rank, ctx.world_size)
    cfg = compose_job(model_dir, layout, mode, r3=r3)
    a = cfg.actor_rollout_ref
    model_config = omega_conf_to_dataclass(a.model)
    actor = omega_conf_to_dataclass(a.actor)
    actor.model_config = model_config
    twc = TrainingWorkerConfig(model_type="language_model", model_config=model_config, engine_config=actor.engine,
                               optimizer_config=actor.optim, checkpoint_config=actor.checkpoint)
    # as ActorRolloutRefWorker.init_model assigns them
    twc.engine_config.use_dynamic_bsz = True
    twc.engine_config.infer_max_token_len_per_gpu = a.rollout.log_prob_max_token_len_per_gpu
    twc.engine_config.max_token_len_per_gpu = a.actor.ppo_max_token_len_per_gpu
    worker = TrainingWorker(config=twc)
    with build_shims(attention=ATTENTION):
        worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    engine = worker.engine
    chunks = unwrapped_chunks(engine)
    tp, sp = layout.tp, layout.tp > 1
    tp_rank = ps.get_tensor_model_parallel_rank()
    result: dict[str, Any] = {"engine_class": f"{type(engine).__module__}.{type(engine).__qualname__}",
                              "from_registry": type(engine) is _registered_engine(),
                              "passes": [], "state_left": [], "metrics": [], "r2_transport": []}
    log = DispatchLog("verl") if canonical is not None else None
    for step in range(len(canonical) if canonical is not None else steps):
        if canonical is None:
            roll, sample_of = make_rollout(seed=100 + step, with_routes=mode == "R3"), None
        else:
            roll = from_canonical(canonical[step], with_routes=mode == "R3", seed=step)
            sample_of = sample_by_tokens(roll.tokens)
        lp = old_log_prob_batch(roll.td)
        out, tg, tv = _log_prob_pass(result, step, worker.infer_batch, lp, roll, chunks, engine, mode,
                                     tp=tp, tp_rank=tp_rank, sp=sp, sample_of=sample_of, log=log)
        if out is not None:
            result["metrics"].append(("compute_log_prob", sorted(tu.get(out, "metrics"))))
        out = _broadcast_output(out)
        if mode == "R2" and ps.get_tensor_model_parallel_rank() == 0:
            sent = nested_routes_to_samples(tu.get(out, "routed_experts"))
            result["r2_transport"].append(_compare_transport(sent, tg, tv))
        upd = update_batch(_with_old_log_probs(roll.td, lp, out, mode), mini_batch_size=len(roll.tokens))
        with RoutingProbe(chunks) as rp, MicroBatchProbe(chunks, sample_of) as mp:
            uout = worker.train_mini_batch(upd)
        if log is not None:
            log_dispatch(log, step, "update", rp, mp, chunks, {s: len(t) for s, t in enumerate(roll.tokens)})
        result["passes"].append(check_pass(f"step{step}/update", rp, mp, tg, tv, tp=tp, tp_rank=tp_rank, sp=sp))
        result["state_left"] += [f"step{step}/update: {x}" for x in _engine_state(engine)]
        if uout is not None:
            result["metrics"].append(("update", sorted(tu.get(uout, "metrics"))))
            result.setdefault("metric_values", []).append(
                {k: v for k, v in tu.get(uout, "metrics").items() if k.startswith("r3bridge/")})
    if log is not None:
        result["dispatch"] = log.records()
    return result


def run_actor_ref_worker(ctx: Any, model_dir: str, layout: JobLayout, mode: str, steps: int) -> dict:
    """``ActorRolloutRefWorker``: a role ``ref`` and a role ``actor`` worker in one process, as
    verl's trainer colocates them (``create_colocated_worker_cls``; the rollout role needs vLLM /
    SGLang), driven as ``RayPPOTrainer`` drives them: ``compute_log_prob``,
    ``compute_ref_log_prob``, ``update_actor`` (shuffled mini-batches), ``steps`` times."""
    from megatron.core import parallel_state as ps
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from r3bridge.megatron.hook import RouterHook
    from r3bridge.testing.harness.probe import RoutingProbe, find_routers
    from testlab.verl_cpu import build_shims

    ps.destroy_model_parallel()
    set_rank_env(ctx.rank, ctx.world_size)
    cfg = compose_job(model_dir, layout, mode)
    ref_w = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="ref")
    actor_w = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    with build_shims(attention=ATTENTION):
        ref_w.init_model()
        actor_w.init_model()
    actor, ref = actor_w.actor.engine, ref_w.ref.engine
    chunks, ref_chunks = unwrapped_chunks(actor), unwrapped_chunks(ref)
    tp, sp = layout.tp, layout.tp > 1
    tp_rank = ps.get_tensor_model_parallel_rank()
    result: dict[str, Any] = {
        "engine_class": f"{type(actor).__module__}.{type(actor).__qualname__}",
        "ref_engine_class": f"{type(ref).__module__}.{type(ref).__qualname__}",
        "from_registry": type(actor) is _registered_engine() and type(ref) is _registered_engine(),
        "ref_hooks": sum(isinstance(r.module.router_replay, RouterHook) for r in find_routers(ref_chunks)),
        "ref_replayer": ref.r3.replayer is not None,
        "passes": [], "state_left": [], "metrics": [], "r2_transport": [], "ref": []}
    mini = 4
    result["roles"] = _role_scenarios(actor, ref, ref_w, chunks, ref_chunks, make_rollout(seed=199, with_routes=True))
    for step in range(steps):
        roll = make_rollout(seed=200 + step, with_routes=mode == "R3")
        lp = old_log_prob_batch(roll.td)
        out, tg, tv = _log_prob_pass(result, step, actor_w.compute_log_prob, lp, roll, chunks, actor, mode,
                                     tp=tp, tp_rank=tp_rank, sp=sp)
        native: dict = tg if mode == "R2" else {}
        lens = {s: len(t) for s, t in enumerate(roll.tokens)}
        out = _broadcast_output(out)
        if mode == "R2" and tp_rank == 0:
            result["r2_transport"].append(_compare_transport(nested_routes_to_samples(tu.get(out, "routed_experts")),
                                                             tg, tv))
        # the reference model: routes natively, whatever the batch carries
        rlp = ref_log_prob_batch(roll.td)
        ref_record: dict = {}
        with RoutingProbe(ref_chunks) as rp, MicroBatchProbe(ref_chunks) as mp:
            ref_w.compute_ref_log_prob(rlp)
        check_pass(f"step{step}/ref", rp, mp, {}, {}, tp=tp, tp_rank=tp_rank, sp=sp, record=ref_record)
        ref_routes, ref_valid = recorded_to_targets(_gather_record(ref_record), lens)
        rollout_t, rollout_v = _routes_of(roll)
        result["ref"].append({
            "step": step,
            # R3: how often the reference's native choice equals the rollout route it must ignore
            "agree_rollout": _agreement(ref_routes, rollout_t, rollout_v) if mode == "R3" else None,
            # R2, first step: actor and reference have the same weights: same native routes
            "equal_actor_native": (_agreement(ref_routes, native, ref_valid) if mode == "R2" and step == 0
                                   else None),
            "state": _engine_state(ref)})
        upd = update_batch(_with_old_log_probs(roll.td, lp, out, mode), mini_batch_size=mini, seed=step)
        with RoutingProbe(chunks) as rp, MicroBatchProbe(chunks) as mp:
            uout = actor_w.update_actor(upd)
        result["passes"].append(check_pass(f"step{step}/update", rp, mp, tg, tv, tp=tp, tp_rank=tp_rank, sp=sp))
        result["state_left"] += [f"step{step}/update: {x}" for x in _engine_state(actor)]
        if uout is not None:
            result["metrics"].append(("update", sorted(tu.get(uout, "metrics"))))
    return result


def _role_scenarios(actor: Any, ref: Any, ref_w: Any, chunks: list, ref_chunks: list, roll: Rollout) -> dict:
    """Only the actor replays (r3bridge.megatron.roles), in verl's colocated actor + reference
    worker: the roles each engine declared, and what each way of crossing roles raises (the
    error's class and message, or "no error")."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3bridge.megatron.roles import model_routers, role_of

    def outcome(fn) -> str:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            return f"{type(e).__name__}: {e}"
        return "no error"

    def install_on_reference():
        # the actor's replay step handed a reference chunk (routes reaching another role)
        with actor.r3.replayer.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            st.install(ref.module[0], None, [len(t) for t in roll.tokens])

    out = {"actor": sorted({str(getattr(role_of(r), "value", None)) for c in chunks for _, r in model_routers(c)}),
           "reference": sorted({str(getattr(role_of(r), "value", None)) for c in ref_chunks for _, r in model_routers(c)}),
           "routes_to_reference": outcome(install_on_reference)}
    # what TopKRouter builds under moe_enable_routing_replay=True (e.g. the reference's
    # override_transformer_config or router_replay.mode set for it): a RouterReplay in megatron's
    # process-global list, which every set_global_router_replay_action for the actor drives too
    # every rank raises before verl's schedule (a rank that went on would wait for its pipeline peer)
    router = next(r for c in ref_chunks for _, r in model_routers(c))
    router.router_replay = RouterReplay()
    try:
        out["reference_with_megatron_replay"] = outcome(lambda: ref_w.compute_ref_log_prob(ref_log_prob_batch(roll.td)))
    finally:
        RouterReplay.global_router_replay_instances.remove(router.router_replay)
        router.router_replay = None
    return out


def _registered_engine() -> type:
    """What verl's ``EngineRegistry`` picks for a Megatron language model on this machine."""
    from verl.workers.engine.base import EngineRegistry

    return EngineRegistry.get_engine_cls("language_model", "megatron")


def _agreement(a: dict, b: dict, valid: dict) -> float:
    """Fraction of (valid row, MoE layer) pairs where two route sets are equal."""
    same = total = 0
    for s, v in valid.items():
        if s not in a or s not in b:
            continue
        for j in np.nonzero(v)[0]:
            for layer in MOE_LAYERS:
                total += 1
                same += sorted(a[s][j, layer].tolist()) == sorted(int(x) for x in b[s][j, layer])
    return same / max(total, 1)


def run_layout(ctx: Any, model_dir: str, layout: JobLayout, worker_mode: str, actor_ref_mode: str,
               steps: int = 2) -> dict:
    """One layout in one set of processes: a ``TrainingWorker`` job in ``worker_mode``, then an
    ``ActorRolloutRefWorker`` actor + reference job in ``actor_ref_mode``."""
    if ctx.layout.tp != layout.tp or ctx.layout.pp != layout.pp or ctx.layout.vpp != layout.vpp:
        raise ValueError(f"process layout {ctx.layout} differs from the job's {layout}")
    out = {"training_worker": run_training_worker(ctx, model_dir, layout, worker_mode, steps)}
    out["actor_ref"] = run_actor_ref_worker(ctx, model_dir, layout, actor_ref_mode, steps)
    return out


def _gather_record(record: dict) -> dict:
    """R2 record of this rank's router rows, merged over TP / PP ranks (each rank routes a
    sequence shard (SP) or its own layers (PP))."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return record
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, record)
    merged: dict = {}
    for part in parts:
        for s, rows in part.items():
            for j, per_layer in rows.items():
                merged.setdefault(s, {}).setdefault(j, {}).update(per_layer)
    return merged


def _broadcast_output(out: Any) -> Any:
    """verl's single controller collects the output of the model-parallel source rank and
    sends the next call's batch to all: every rank gets the source rank's output here."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return out
    box = [out]
    src = _output_rank()
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _output_rank() -> int:
    from megatron.core import parallel_state as ps

    ranks = [None] * torch.distributed.get_world_size()
    mine = (ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage(ignore_virtual=True))
    torch.distributed.all_gather_object(ranks, mine)
    return ranks.index(True)


def _compare_transport(sent: list[np.ndarray], targets: dict, valid: dict) -> list[str]:
    """R2: verl's ``routed_experts`` output (MoE layers, in layer order, as verl's own R2 records
    them) must carry, for each sample in original order, exactly the routes its routers chose."""
    bad = []
    if len(sent) != len(targets):
        return [f"{len(sent)} samples sent for {len(targets)} routed"]
    for s, arr in enumerate(sent):
        if arr.shape[1] != len(MOE_LAYERS) or arr.shape[0] < int(valid[s].sum()):
            bad.append(f"sample {s}: sent shape {tuple(arr.shape)}")
            continue
        for j in np.nonzero(valid[s])[0]:
            for li, layer in enumerate(MOE_LAYERS):
                got, want = sorted(arr[j, li].tolist()), sorted(targets[s][j, layer].tolist())
                if got != want:
                    bad.append(f"sample {s} row {j} layer {layer}: sent {got}, routed {want}")
    return bad


__all__ = ["JobLayout", "MicroBatchProbe", "PassCheck", "Rollout", "check_pass", "compose_job", "from_canonical",
           "log_dispatch", "make_rollout", "old_log_prob_batch", "ref_log_prob_batch", "sample_by_tokens",
           "update_batch", "write_tiny_qwen3_moe"]
