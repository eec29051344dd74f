"""Routes by reference in SkyRL's job (``r3bridge.route_transport: handles``, docs/route-handles.md).

SkyRL's trainer (the driver process) turns the generator's output into a ``TrainingInputBatch`` and
hands every policy worker the whole field; one rank replays a fraction of it. With handles, the
trainer writes each sample's routes **once** (:class:`RouteWriter`: R3's rollout routes from the
generator's output, R2's recorded routes), and the batch carries, instead of the route bytes:

* in ``rollout_expert_indices``: each row's sample id (``[B, 1, 1, 1]`` int32,
  :func:`r3bridge.adapters.skyrl.id_field.sample_id_field`). It is the one per-sample field SkyRL
  carries into every micro-batch, through its permutations, its DP split, its padding rows (copies
  of row 0: they read sample 0's routes, as their tokens are sample 0's) and token-based
  micro-batching (its padding micro-batch: zeros, no sample);
* in the batch's ``metadata`` (``HANDLES_KEY``): :class:`BatchHandles`, the run id, the RL step and
  one :class:`r3bridge.handles.RouteHandle` per sample id (a few hundred bytes each; Ray object
  references travel through Ray's own serializer, counted). SkyRL's compute_log_prob keeps only
  ``response_length`` of the metadata (``fwd_logprobs_values_reward``'s ``select``):
  :class:`~r3bridge.adapters.skyrl.hooks.TrainerMixin` puts the handles back into that pass's batch.

Each policy worker resolves, per micro-batch, only its rows of its stage's layers through the
core's reader (:func:`r3bridge.handles.handed_routes`), every byte read checked against its digest;
a missing, truncated or changed object fails closed naming SkyRL's sample (its batch row and uid).
The trainer releases a step's routes when its training ends (kept when ``trace_dir`` is set).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from r3bridge.adapters.skyrl.codec import MASK_KEY, ROUTES_KEY, ROUTES_MARK
from r3bridge.adapters.skyrl.id_field import is_sample_id_field, sample_id_field, sample_ids_from_field
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import ReplayConfig
from r3bridge.errors import ConfigError, LayerMappingError, RouteShapeError
from r3bridge.handles import FileRoutes, RayRoutes, RouteHandle, RouteStore, SampleRoutes, handed_routes
from r3bridge.handles.handle import table_digest
from r3bridge.hf import ModelInfo
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["HANDLES_KEY", "STALE_RUN_AGE_S", "BatchHandles", "RouteWriter", "micro_batch_routes"]

HANDLES_KEY = "r3bridge_route_handles"      # TrainingInputBatch.metadata: the batch's BatchHandles
# route_store a folder: at start, a run folder nothing was written to for this long is a killed run's
# (a live run writes every step and releases at its end; a step's training takes minutes, not hours)
STALE_RUN_AGE_S = 6 * 3600.0
WRITE_THREADS = 8          # the driver's writer threads at most (a batch's samples written side by side)


@dataclasses.dataclass(frozen=True)
class BatchHandles:
    """One batch's routes by reference: sample id ``i`` (what ``rollout_expert_indices`` carries)
    -> ``handles[i]``; ``run_id`` / ``step`` the reader checks every handle against; ``store`` /
    ``directory``: where the worker resolves them."""

    run_id: str
    step: int
    store: str                       # "files" | "ray" (the backend's name, what each handle's ``store`` says)
    directory: Optional[str]         # FileRoutes' folder (None: Ray)
    handles: tuple[RouteHandle, ...]

    def __repr__(self) -> str:      # SkyRL prints a batch's metadata: one line, not every handle
        return (f"BatchHandles(run {self.run_id} step {self.step}: {len(self.handles)} samples in "
                f"{self.store}{'' if self.directory is None else ' ' + self.directory})")

    def __deepcopy__(self, memo: dict) -> "BatchHandles":
        # SkyRL's pad_training_input_batch deep-copies metadata: the handles are immutable, and a
        # Ray object reference must stay the one Ray counts
        return self

    def resolvers(self) -> dict[str, Any]:
        return {self.store: FileRoutes(self.directory, name=self.store) if self.directory is not None
                else RayRoutes(name=self.store)}


class RouteWriter:
    """The trainer's store of routes by reference (SkyRL's driver process: one per job). ``config``:
    the ``r3bridge`` section (``route_store``, ``trace_dir``: kept for traces). Files: stale runs'
    folders (:data:`STALE_RUN_AGE_S`) are removed when it starts."""

    def __init__(self, config: ReplayConfig, *, run_id: Optional[str] = None, directory: Optional[str] = None) -> None:
        if config.route_store != "ray":     # a folder (``directory`` overrides it: tests)
            backend: Any = FileRoutes(directory or config.route_store)
            self.directory: Optional[str] = backend.directory
        else:
            backend, self.directory = RayRoutes(), None
        # the driver writes a whole batch at once: its samples on threads (files and Ray objects
        # take concurrent writes; the copy, crc32s and writes release the GIL)
        self.store = RouteStore(backend, run_id=run_id, keep=config.trace_dir is not None,
                                workers=min(WRITE_THREADS, os.cpu_count() or 1))
        if self.directory is not None:
            backend.remove_stale_runs(STALE_RUN_AGE_S, keep=[self.store.run_id])

    def _batch_handles(self, step: int, handles: Sequence[RouteHandle]) -> BatchHandles:
        return BatchHandles(self.store.run_id, int(step), self.store.name, self.directory, tuple(handles))

    def write_rollout(self, batch: Any, routes: Optional[Sequence[Any]], uids: Sequence[str], *, step: int,
                      model: ModelInfo) -> None:
        """R3: the generator's ``rollout_expert_indices`` (per sample ``[rows, num_hidden_layers, K]``
        from token 0, the rows the engine routed, multi-turn first-seen) written once, the
        batch's field and metadata set (module docstring). ``routes`` None: nothing written (the
        worker refuses a replay without routes, naming the SkyRL setting)."""
        if routes is None:
            return
        seq_lens = [int(n) for n in batch["attention_mask"].sum(-1).tolist()]
        if len(routes) != len(seq_lens):
            raise RouteShapeError(f"SkyRL's generator returned routes for {len(routes)} samples, the batch has "
                                  f"{len(seq_lens)}")
        moe = list(model.moe_layer_ids)
        entries = []
        for i, (sample_routes, n) in enumerate(zip(routes, seq_lens)):
            name = _sample_name(i, uids)
            rows = _generator_rows(name, sample_routes, n, model)
            entries.append(SampleRoutes(name, rows[:, moe], moe, 0, model.num_experts))
        _carry(batch, self._batch_handles(step, self.store.put_many(entries, step=step)))

    def write_recorded(self, batch: Any, recorded: ReplayBatch, uids: Sequence[str], *, step: int) -> None:
        """R2: the routes compute_log_prob recorded (one sequence per batch row) written once, the
        batch's field and metadata set, the batch marked as carrying recorded routes."""
        names = [_sample_name(i, uids) for i in range(recorded.num_seqs)]
        _carry(batch, self._batch_handles(step, self.store.put_batch(recorded, names, step=step)))
        batch.metadata[ROUTES_MARK] = "recorded"

    def release(self, step: int) -> int:
        """The step's routes deleted (its training ended; kept for traces): how many."""
        return self.store.release(step)


def _sample_name(row: int, uids: Sequence[str]) -> str:
    """SkyRL's sample as errors and keys name it: its training-batch row and its prompt uid."""
    uid = str(uids[row]).replace("/", "_") if row < len(uids) else "?"
    return f"row{row}-uid{uid}"


def _generator_rows(name: str, sample_routes: Any, seq_len: int, model: ModelInfo) -> np.ndarray:
    """One sample's generator routes as ``[rows, num_hidden_layers, K]``, cut to the tokens the
    trainer sees (as SkyRL's batch conversion cuts them). The generator's list holds the rows the
    engine routed and nothing past them (SkyRL 0.3's nested lists, 0.4's ``RoutedExpertTrace``
    prefix): every row is a route, a row of repeated ids a degenerate one (the reader refuses it,
    or routes it natively under ``degenerate_routes: native``); the zero rows that mean "no route"
    exist only in the dense field SkyRL 0.3 would build from it."""
    if sample_routes is None or len(sample_routes) == 0:
        return np.zeros((0, model.num_layers, model.topk), dtype=np.int32)
    a = np.asarray(sample_routes)
    if a.ndim != 3 or a.dtype.kind not in "iu":
        raise RouteShapeError(f"SkyRL sample {name!r}: routes must be integer [rows, layers, topk], got shape "
                              f"{tuple(a.shape)} of {a.dtype}")
    if a.shape[1] != model.num_layers:
        raise LayerMappingError(f"SkyRL sample {name!r}: routes of {a.shape[1]} layers, the model has "
                                f"{model.num_layers} decoder layers (SkyRL's vLLM returns every layer)")
    return a[:seq_len]


def _carry(batch: Any, handles: BatchHandles) -> None:
    # one id per row ([B, 1, 1, 1]: 4 bytes a sample, not a token: SkyRL only moves the field by row)
    batch[ROUTES_KEY] = sample_id_field(range(int(batch["attention_mask"].shape[0])), 1)
    if MASK_KEY in batch:
        batch[MASK_KEY] = None
    if getattr(batch, "metadata", None) is None:
        batch.metadata = {}
    batch.metadata[HANDLES_KEY] = handles


def _no_route(like: RouteHandle, name: str) -> RouteHandle:
    """A handle of no rows (SkyRL's padding micro-batch: no sample): read as "no route", never opened."""
    empty = np.zeros((like.num_layers, 0), dtype=np.uint32)
    return dataclasses.replace(like, key=f"{like.run_id}/{like.step}/{name}", sample=name, rows=0, start_row=0,
                               digest=table_digest(empty), ref=None)


def micro_batch_routes(field: Any, handles: BatchHandles, seq_lens: Sequence[int],
                       resolvers: Mapping[str, Any], *, route_kind: str) -> HandedRoutes:
    """A worker micro-batch's routes: its ``rollout_expert_indices`` (sample ids) -> those samples'
    handles, handed to the driver unread (:func:`r3bridge.handles.handed_routes`: this rank's rows
    of each chunk's layers are read when the chunk runs, digests checked)."""
    if field is None or not is_sample_id_field(field):
        raise ConfigError("route_transport=handles: the micro-batch's rollout_expert_indices holds routes, not "
                          "sample ids (the batch was not written by r3bridge's TrainerMixin with handles)")
    ids = sample_ids_from_field(field, len(seq_lens))
    picked = []
    for k, i in enumerate(ids):
        if i is not None and not 0 <= i < len(handles.handles):
            raise RouteShapeError(f"micro-batch row {k}: sample id {i}, the batch's route handles hold "
                                  f"{len(handles.handles)} samples")
        picked.append(handles.handles[i] if i is not None else _no_route(handles.handles[0], f"padding row {k}"))
    for h in picked:
        if h.route_kind != route_kind:
            raise ConfigError(f"{h.where()}: the pass replays {route_kind} routes, the handle holds {h.route_kind} "
                              f"routes")
    return handed_routes(picked, resolvers, seq_lens, run_id=handles.run_id, step=handles.step, framework="SkyRL")
