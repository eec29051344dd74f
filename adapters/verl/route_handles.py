"""Routes by reference in verl's job (``r3bridge.route_transport: handles``, docs/route-handles.md).

Written once, where the routes appear: r3bridge's agent loops (:mod:`.agent_loop`) store each
sample's routes, as the trainer replays them (first-seen stitched, the model's MoE layers), under
``<run id>/<RL step>/<sample>`` and put the small handle's JSON into the sample's ``extra_fields``
(:data:`HANDLE_KEY`) instead of the bytes in ``routed_experts``: verl's TransferQueue and every
worker's pull then move a few hundred bytes per sample. Read at the rank: the engine
(:mod:`.hooks`) hands the driver each micro-batch's handles (:func:`r3bridge.handles.handed_routes`),
so each rank reads only its rows of its stage's layers, every byte checked. Lifetime: the engine
deletes a step's routes after the step's last update pass, and with them what earlier steps left
that no update pass reads (validation rollouts' routes: verl's agent loop cannot tell them from
training ones); all kept when ``trace_dir`` is set. The launcher removes what earlier, killed
runs left.

The run id reaches both sides as ``R3BRIDGE_ROUTES_RUN`` in Ray's runtime env (the launcher draws
it, :func:`launch_run_id`), never through a registry. The RL step is the sample's own
``global_steps`` (the step verl's trainer drew its prompt for: the agent loop gets it as a keyword,
the trainer's batch carries it per sample), so a handle that another step left in a sample's field
is refused.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from r3bridge.config import ReplayConfig
from r3bridge.errors import ConfigError, CoverageError
from r3bridge.handles import FileRoutes, RouteHandle, RouteHandleError, RouteStore

__all__ = ["HANDLE_KEY", "RECORDED_HANDLE_KEY", "RUN_ENV", "STALE_RUN_AGE_S", "uses_handles", "check_route_store", "launch_run_id",
           "route_run_id", "resolvers", "RouteWriter", "sample_name", "sample_handles", "sample_steps",
           "release_handles", "RouteHandles"]

HANDLE_KEY = "r3bridge_route_handle"      # in each sample's extra_fields: its route handle's JSON
RECORDED_HANDLE_KEY = "r3bridge_recorded_handle"     # R2: per sample, the handle of compute_log_prob's recording
RUN_ENV = "R3BRIDGE_ROUTES_RUN"           # the run id the launcher hands every worker
# a run folder nothing wrote to for this long is a killed run's (a live run writes every step)
STALE_RUN_AGE_S = 6 * 3600.0


def uses_handles(cfg: ReplayConfig) -> bool:
    return cfg.route_transport == "handles"


def check_route_store(cfg: ReplayConfig) -> Optional[str]:
    """What verl's job cannot do with ``cfg.route_store`` (``None``: fine). Ray's object store is
    refused: the objects' owner would be the agent-loop worker and verl's TransferQueue pickles
    the handle outside Ray, so neither the owner's reference count nor the trainer's release would
    govern their lifetime."""
    if uses_handles(cfg) and cfg.route_store == "ray":
        return ("r3bridge.route_store=ray: verl's agent loops hand their outputs to verl's TransferQueue, which "
                "pickles them outside Ray, so Ray could not track a handle's object references; use a folder "
                "(the default /dev/shm/r3bridge-routes on one node, a shared file system's folder across nodes)")
    return None


def launch_run_id(cfg: ReplayConfig) -> dict[str, str]:
    """The launcher's part: a fresh run id for the workers' environment (``{}`` for inline routes),
    after removing the folders of runs that wrote nothing for :data:`STALE_RUN_AGE_S` (killed runs':
    under ``/dev/shm`` they hold memory)."""
    if not uses_handles(cfg):
        return {}
    FileRoutes(cfg.route_store).remove_stale_runs(STALE_RUN_AGE_S)
    return {RUN_ENV: uuid.uuid4().hex[:16]}


def route_run_id(environ: Optional[Mapping[str, str]] = None) -> str:
    """This job's run id (``R3BRIDGE_ROUTES_RUN``), else ``ConfigError``: a worker not started by
    r3bridge's launcher cannot know which run's routes it may read."""
    run = (os.environ if environ is None else environ).get(RUN_ENV, "")
    if not run:
        raise ConfigError(f"r3bridge.route_transport=handles: {RUN_ENV} is not set in this worker; r3bridge's "
                          f"launcher (python -m r3bridge.adapters.verl.main_ppo) sets it for every Ray worker")
    return run


def resolvers(cfg: ReplayConfig) -> dict[str, FileRoutes]:
    """The reader's stores (store name -> resolver)."""
    files = FileRoutes(cfg.route_store)
    return {files.name: files}


class RouteWriter:
    """One agent loop's writer: a sample's routes in the engine's layer axis ``[rows, L_src, K]``
    -> the model's MoE layers stored once for RL step ``step``; the handle's JSON."""

    def __init__(self, cfg: ReplayConfig, *, moe_layer_ids: Sequence[int], num_hidden_layers: int,
                 num_experts: int, run_id: Optional[str] = None) -> None:
        self.store = RouteStore(FileRoutes(cfg.route_store), run_id=run_id or route_run_id(),
                                keep=cfg.trace_dir is not None)
        self.cfg = cfg
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = int(num_hidden_layers)
        self.num_experts = int(num_experts)

    def put(self, routes: Any, *, step: int, sample: str) -> str:
        """``routes``: one sample's rows from token 0 (verl's ``routed_experts``). Rows after the
        last routed one (the last token, never fed back) are not stored: the reader gives them no
        route, as verl's zero rows; an unrouted row before a routed one is refused (a handle stores
        one run of rows)."""
        from r3bridge.adapters.verl.nested import layer_columns

        a = np.asarray(routes)
        if a.ndim != 3:
            raise RouteHandleError(f"sample {sample!r}: routed_experts must be [rows, layers, topk], got {a.shape}")
        cols = layer_columns(int(a.shape[1]), route_kind="rollout", moe_layer_ids=self.moe_layer_ids,
                             field="routed_experts", num_hidden_layers=self.num_hidden_layers,
                             layer_axis=self.cfg.layer_axis)
        moe = a if cols is None else a[:, cols]
        routed = moe.reshape(moe.shape[0], -1).any(axis=1)
        rows = int(np.flatnonzero(routed)[-1]) + 1 if routed.any() else 0
        holes = np.flatnonzero(~routed[:rows])
        if holes.size:
            raise CoverageError(f"sample {sample!r}: row {int(holes[0])} has no route (all zeros) before routed row "
                                f"{rows - 1}; a route handle stores one run of routed rows")
        handle = self.store.put(sample, moe[:rows].astype(np.int16), self.moe_layer_ids, 0, step=int(step),
                                num_experts=self.num_experts)
        return handle.to_json()


def sample_name(kwargs: Mapping[str, Any]) -> str:
    """A name unique across a run's samples, retries and attempts: verl's prompt ``uid``, the
    ``session_id`` of ``rollout.n`` and a fresh suffix (a retried or repeated loop never overwrites)."""
    return f"{kwargs.get('uid', 'sample')}_{kwargs.get('session_id', 0)}_{uuid.uuid4().hex[:8]}"


def sample_handles(texts: Sequence[Any], names: Sequence[str]) -> list[RouteHandle]:
    """Each sample's handle from its ``extra_fields[HANDLE_KEY]`` (the handle's JSON), in batch
    order; a sample without one is refused, naming it and the agent loop it needs."""
    out = []
    for text, name in zip(texts, names):
        if text is None:
            raise RouteHandleError(f"{name}: no route handle in its extra_fields[{HANDLE_KEY!r}] under "
                                   f"r3bridge.route_transport=handles: its agent loop put no routes by reference (set "
                                   f"the agent loop's _target_ to r3bridge.adapters.verl.agent_loop's "
                                   f"FirstSeenToolAgentLoop / HandleSingleTurnAgentLoop)")
        try:
            out.append(RouteHandle.from_json(text))
        except RouteHandleError as e:
            raise RouteHandleError(f"{name}: extra_fields[{HANDLE_KEY!r}] is {e}") from None
    return out


def _as_list(value: Any) -> list:
    """A per-sample field as a plain list (verl's ``NonTensorStack`` lists its values by ``tolist``)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def sample_steps(data: Any, names: Sequence[str]) -> list[int]:
    """Each sample's RL step (verl's per-sample ``global_steps``: the step its prompt was drawn for)."""
    value = data.get("global_steps", None) if hasattr(data, "get") else None
    if value is None:
        raise RouteHandleError(f"{names[0] if names else 'the batch'}: the batch has no global_steps field (verl's "
                               f"V1 trainer carries it per sample); routes by reference are read for their sample's step")
    values = _as_list(value) if hasattr(value, "tolist") or isinstance(value, (list, tuple)) else [value] * len(names)
    return [int(v) for v in values]


def release_handles(handles: Sequence[RouteHandle], cfg: ReplayConfig) -> int:
    """Delete the stored routes of ``handles`` (a step's consumed samples), unless ``trace_dir``
    keeps them; how many were deleted."""
    if cfg.trace_dir is not None:
        return 0
    files = FileRoutes(cfg.route_store)
    for h in handles:
        files.delete(h)
    return len(handles)


class RouteHandles:
    """The engine's side of routes by reference: the pass's handles (batch order, :meth:`take`),
    each micro-batch's :class:`~r3bridge.HandedRoutes` (:meth:`micro_batch`), the step's release
    (:meth:`pass_done`)."""

    def __init__(self, cfg: ReplayConfig, *, run_id: Optional[str] = None) -> None:
        self.cfg = cfg
        self.run_id = run_id or route_run_id()
        self.resolvers = resolvers(cfg)
        self.batch: list[RouteHandle] = []     # this pass's, in the batch's order
        self.steps: list[int] = []
        self._consumed: dict[str, RouteHandle] = {}     # the step's update passes' (released after the last)

    def take(self, data: Any) -> bool:
        """Read the batch's handles (the rollout's: ``extra_fields[HANDLE_KEY]`` of each sample;
        R2's recording: the :data:`RECORDED_HANDLE_KEY` field) and RL steps; False when no sample
        carries one (routes inline, or none)."""
        from r3bridge.adapters.verl.sample_fields import sample_field

        self.batch, self.steps = [], []
        texts = sample_field(data, RECORDED_HANDLE_KEY)
        texts = _as_list(texts) if texts is not None else sample_field(data, HANDLE_KEY, nested="extra_fields")
        if texts is None:
            if data.get("routed_experts", None) is not None:     # never read inline under handles: not silently
                raise ConfigError("r3bridge.route_transport=handles, but the batch carries routed_experts inline and "
                                  "no route handles: its agent loops are verl's own; set their _target_ to "
                                  "r3bridge.adapters.verl.agent_loop's FirstSeenToolAgentLoop / HandleSingleTurnAgentLoop "
                                  "(docs/use-with-verl.md, 'Routes by reference')")
            return False
        names = self._names(data, len(texts))
        self.batch = sample_handles(texts, names)
        self.steps = sample_steps(data, names)
        return True

    @staticmethod
    def _names(data: Any, count: int) -> list[str]:
        import torch

        from r3bridge.adapters.verl.sample_fields import indexed_names

        return indexed_names(count, torch.arange(count), data.get("uid", None))

    def store_recorded(self, recorded: Any, data: Any) -> list[str]:
        """R2: compute_log_prob's recording (a :class:`~r3bridge.ReplayBatch`, one sequence per
        sample in batch order) stored once, per sample for its own RL step; the handles' JSON in
        batch order (what goes back to verl instead of the routes)."""
        import numpy as np
        import torch

        names = self._names(data, recorded.num_seqs)
        steps = sample_steps(data, names)
        uids = data.get("uid", None)
        uids = _as_list(uids) if uids is not None and not isinstance(uids, torch.Tensor) else [None] * recorded.num_seqs
        store = RouteStore(FileRoutes(self.cfg.route_store), run_id=self.run_id, keep=self.cfg.trace_dir is not None)
        offs, valid, routes = recorded.offsets.tolist(), recorded.valid.cpu().numpy(), recorded.routes.cpu().numpy()
        out = []
        for i, step in enumerate(steps):
            lo, hi = offs[i], offs[i + 1]
            bad = np.flatnonzero(~valid[lo:hi])
            if bad.size:
                raise CoverageError(f"{names[i]}: recorded row {int(bad[0])} has no route; R2 records every token")
            sample = f"{uids[i] if uids[i] is not None else 'sample'}_recorded_{uuid.uuid4().hex[:8]}"
            out.append(store.put(sample, routes[lo:hi].astype(np.int16), recorded.layer_ids, recorded.start_rows[i],
                                 step=step, num_experts=recorded.num_experts, route_kind="recorded").to_json())
        return out

    def check_topk(self, session: Any, *, where: str) -> None:
        for h in self.batch:
            session.check_topk(f"extra_fields[{HANDLE_KEY!r}] of {h.where()}", h.topk, where=where)

    def micro_batch(self, indices: Sequence[int], seq_lens: Sequence[int]) -> Any:
        """The micro-batch of batch samples ``indices`` (the trainer's token counts ``seq_lens``)
        as the one reader's ``HandedRoutes``: nothing read yet, each handle checked against this
        run and its sample's step."""
        from r3bridge.handles import handed_routes

        idx = [int(i) for i in indices]
        return handed_routes([self.batch[i] for i in idx], self.resolvers, seq_lens, run_id=self.run_id,
                             step=[self.steps[i] for i in idx], framework="verl")

    def pass_done(self, *, update: bool, last_of_step: bool, releases: bool) -> int:
        """After a pass: an update pass's handles are the step's consumed ones; after the step's
        last update pass (``last_of_step``: verl's ``update_lr_scheduler``) every rank has read its
        rows, and the rank that ``releases`` (one per data-parallel replica: its samples) deletes
        them; when they were all of one RL step, also every route file of older steps (validation's,
        which no update pass reads). How many it deleted."""
        if update:
            self._consumed.update((h.key, h) for h in self.batch)
        self.batch, self.steps = [], []
        if not (update and last_of_step):
            return 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()          # every rank's last read of the step done before any file goes
        consumed, self._consumed = list(self._consumed.values()), {}
        if not releases:
            return 0
        released = release_handles(consumed, self.cfg)
        steps = {h.step for h in consumed}
        if len(steps) == 1 and self.cfg.trace_dir is None:
            # routes of earlier steps that no update pass consumed: validation's (verl's agent loop
            # is not told it runs for _validate, which runs after a step's update and writes for
            # that step). Only when the step consumed one step's samples (verl's synchronous
            # trainers: every prompt of a step is trained on in that step): an off-policy trainer
            # may still train on an older, in-flight prompt, whose routes must stay.
            released += FileRoutes(self.cfg.route_store).remove_steps_before(self.run_id, steps.pop())
        return released
