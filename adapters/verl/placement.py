"""The Ray CPU slots a verl 0.9.1 job holds for its whole run, counted before Ray starts.

Ray places an actor or a placement group only when the slots it asks for are free, and waits
silently otherwise: a local cluster smaller than what verl reserves prints the job's config and
hangs (issues 39 and 50). What verl 0.9.1 reserves, read from its code:

* TransferQueue (the V1 trainer, ``trainer.use_v1``, SimpleStorage backend): its controller and
  each of ``num_data_storage_units`` storage actors, ``num_cpus=1`` each (``transfer_queue``'s
  ``TransferQueueController``, ``SimpleStorageUnit``), created first;
* each resource pool (``ResourcePoolManager``, ``RayResourcePool.get_placement_groups``): one
  placement-group bundle ``{CPU: max_colocate_count (3), GPU: 1}`` per GPU, for the global pool
  (``trainer.n_gpus_per_node`` x ``trainer.nnodes``: actor, rollout, reference, critic), the reward
  model's own pool (``reward.reward_model.enable_resource_pool``) and the distillation teacher's
  (``distillation.enabled``);
* the ``remote`` reward manager: ``reward.num_workers`` ``RewardComputeWorker`` actors
  (``num_cpus=1``) in each of the ``reward.num_workers`` reward loop workers.

The TaskRunner, the agent loop and reward loop workers and the rollout servers are actors with
Ray's default resources (or ``num_cpus=0``): they hold no slot once placed (Ray places such an
actor with no slot free), so they are not counted.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from r3bridge.errors import ConfigError
from r3bridge.job_check import setting

__all__ = ["COLOCATE_SLOTS", "held_cpu_slots", "local_ray_cpu_slots", "check_local_ray_slots"]

COLOCATE_SLOTS = 3      # verl 0.9.1's ResourcePoolManager.max_colocate_count: CPU slots per GPU bundle
NUM_CPUS_KEY = "ray_kwargs.ray_init.num_cpus"


def held_cpu_slots(verl_cfg: Any) -> list[tuple[str, int]]:
    """(what holds them, in verl's keys; CPU slots) for everything the job reserves for its whole run."""
    s = lambda path, d=None: setting(verl_cfg, path, d)  # noqa: E731
    held: list[tuple[str, int]] = []
    units = s("transfer_queue.backend.SimpleStorage.num_data_storage_units")
    if s("trainer.use_v1", True) and s("transfer_queue.backend.storage_backend", "SimpleStorage") == "SimpleStorage" \
            and units is not None:
        held.append((f"TransferQueue: a controller and transfer_queue.backend.SimpleStorage.num_data_storage_units="
                     f"{units} storage actors, 1 each", 1 + int(units)))
    pools = [("trainer", "global pool (actor, rollout, reference)")]
    if s("reward.reward_model.enable_resource_pool", False):
        pools.append(("reward.reward_model", "reward model pool"))
    if s("distillation.enabled", False):
        pools.append(("distillation", "teacher pool"))
    for prefix, name in pools:
        gpus, nodes = int(s(f"{prefix}.n_gpus_per_node", 0) or 0), int(s(f"{prefix}.nnodes", 1) or 1)
        if gpus * nodes:
            held.append((f"the {name}: {prefix}.n_gpus_per_node={gpus} x {prefix}.nnodes={nodes} placement-group "
                         f"bundles of {{CPU: {COLOCATE_SLOTS}, GPU: 1}}", COLOCATE_SLOTS * gpus * nodes))
    if str(s("reward.reward_manager.name", "") or "") == "remote":
        workers = int(s("reward.num_workers", 1) or 1)
        held.append((f"the remote reward manager: reward.num_workers={workers} compute workers in each of "
                     f"{workers} reward loop workers, 1 each", workers * workers))
    return held


def local_ray_cpu_slots(ray_init: Any, cpus: Optional[int] = None) -> Optional[tuple[int, bool]]:
    """(CPU slots, whether ``num_cpus`` set them) of the local Ray cluster that ``ray.init(**ray_init)``
    starts: ``num_cpus``, else the machine's cores as Ray counts them (``cpus`` overrides). ``None``
    when it joins an existing cluster (``address``, ``RAY_ADDRESS``)."""
    if setting(ray_init, "address") or os.environ.get("RAY_ADDRESS"):
        return None
    slots = setting(ray_init, "num_cpus")
    if slots is not None:
        return int(slots), True
    if cpus is None:
        try:
            from ray._private.utils import get_num_cpus
            cpus = int(get_num_cpus())
        except Exception:  # noqa: BLE001  (Ray's private helper moved: the machine's count)
            cpus = os.cpu_count() or 1
    return int(cpus), False


def check_local_ray_slots(verl_cfg: Any, cpus: Optional[int] = None) -> None:
    """A ``ConfigError`` with the numbers when the local Ray cluster the job starts has fewer CPU slots
    than the job holds (:func:`held_cpu_slots`): Ray would wait forever for the rest. ``cpus``: the
    machine's count (default: Ray's own). A job joining an existing cluster is not checked."""
    held = held_cpu_slots(verl_cfg)
    need = sum(n for _, n in held)
    local = local_ray_cpu_slots(setting(verl_cfg, "ray_kwargs.ray_init") or {}, cpus)
    if local is None or local[0] >= need:
        return
    slots, given = local
    where = NUM_CPUS_KEY if given else f"this machine's {slots} cores ({NUM_CPUS_KEY} unset)"
    raise ConfigError(
        f"verl would hold {need} Ray CPU slots for the whole job ({'; '.join(f'{n} for {what}' for what, n in held)}), "
        f"but the local Ray cluster gets {slots} from {where}: Ray would wait forever to place the rest. Set "
        f"{NUM_CPUS_KEY}={need} or more (logical slots: more than the machine's cores is fine), or hold fewer "
        f"(transfer_queue.backend.SimpleStorage.num_data_storage_units=1)")
