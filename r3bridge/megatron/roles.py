"""Which role each model a framework builds plays; only the actor replays.

A job builds several models in one process: the actor, and often a critic, a reference model, a
distillation teacher, and MTP (draft) layers inside the actor. megatron-core's own replay keeps
process-global state (``RouterReplay.global_router_replay_instances`` and the
``set_global_router_replay_action`` / ``set_replay_data`` / ``clear_global_indices`` that act on
every instance of the process), so a build or a call made for one role reaches every other:

* a critic built with an MTP spec re-enabled the global replay switch and crashed (miles #2226);
* a distillation teacher inherited replay and failed every call (NeMo RL #4083);
* MTP layers used another layer's routes (NeMo RL #3903).

r3bridge never uses that global state (its hook is per router instance, :mod:`hook`), and records
roles on the model instances themselves: each router, and each declared chunk (a pipeline stage
of dense layers has no router), carries its role in one attribute (``r3bridge_role``), set when
the framework declares the model. There is no registry object to share or forget; a model's role
lives and dies with the model.

Checks, each raising :class:`r3bridge.errors.RoleError` naming both roles:

* a model declared with one role is declared again with another (one module shared by two roles);
* a router of a non-actor model (or of the actor's MTP block) carries a replay object: the actor's
  hook (actor routes would reach it), or megatron's ``RouterReplay`` (built with
  ``moe_enable_routing_replay=True``: every global replay action meant for the actor drives it);
* :func:`check_actor` (each replay pass): an actor router whose hook or role was changed since the
  Replayer attached, by the build or declaration of another role.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Iterator, Optional, Sequence

import torch

from r3bridge.errors import RoleError

ROLE_ATTR = "r3bridge_role"      # the instance attribute on each TopKRouter and each declared chunk


class Role(str, Enum):
    ACTOR = "actor"
    CRITIC = "critic"
    REFERENCE = "reference"
    TEACHER = "teacher"
    DRAFT = "draft"              # MTP / speculative layers: in the actor's model, never replayed

    @classmethod
    def _missing_(cls, value: object) -> Optional["Role"]:
        return {"ref": cls.REFERENCE}.get(value) if isinstance(value, str) else None   # a framework's spelling of it

    @classmethod
    def of(cls, value: "Role | str") -> "Role":
        try:
            return cls(value)
        except ValueError:
            raise RoleError(f"unknown model role {value!r}: one of {[r.value for r in cls]}") from None


def model_routers(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from megatron.core.transformer.moe.router import TopKRouter

    for name, m in module.named_modules():
        if isinstance(m, TopKRouter):
            yield name, m


def _is_mtp(name: str) -> bool:
    return name == "mtp" or name.startswith("mtp.") or ".mtp." in name


def role_of(router: torch.nn.Module) -> Optional[Role]:
    """The role a router was declared with; None when no model holding it was declared."""
    return getattr(router, ROLE_ATTR, None)


def model_role(module: torch.nn.Module) -> Optional[Role]:
    """The role ``module`` (a model chunk, also one without a router: a pipeline stage of dense
    layers) was declared with, else that of its first declared router; None if none is."""
    own = getattr(module, ROLE_ATTR, None)
    if own is not None:
        return own
    for _, router in model_routers(module):
        role = role_of(router)
        if role is not None:
            return role
    return None


def _replay_owner(obj: Any) -> str:
    """Who a ``router.router_replay`` object belongs to, for messages."""
    from r3bridge.megatron.hook import RouterHook

    if isinstance(obj, RouterHook):
        return "the actor's r3bridge hook (actor routes would reach it)"
    name = type(obj).__name__
    if name == "RouterReplay":
        return ("megatron's RouterReplay (built with moe_enable_routing_replay=True): the process-global "
                "RouterReplay.set_global_router_replay_action / set_replay_data meant for the actor drive it too")
    return f"a replay object {name}"


def declare_role(model_chunks: Sequence[torch.nn.Module] | torch.nn.Module, role: Role | str) -> int:
    """Mark every router of ``model_chunks`` with ``role`` (MTP routers of an actor: ``draft``)
    and refuse what lets routes or replay state cross roles. Returns the number of routers marked.

    Non-actor roles (and the actor's MTP block) must hold no replay object at all. Declaring the
    same model twice with its own role is a no-op; with another role it raises (a module shared by
    two roles would replay for both)."""
    role = Role.of(role)
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    count = 0
    for vp, chunk in enumerate(chunks):
        held = getattr(chunk, ROLE_ATTR, None)
        if held is not None and held is not role:
            raise RoleError(f"model chunk {vp} belongs to the {held.value} model and is now declared {role.value}: "
                            f"one module shared by two roles would replay for both; build a separate model")
        for name, router in model_routers(chunk):
            own = Role.DRAFT if role is Role.ACTOR and _is_mtp(name) else role
            where = f"chunk {vp} router {name or '<root>'} (layer_number {getattr(router, 'layer_number', None)})"
            before = role_of(router)
            if before is not None and before is not own:
                raise RoleError(f"{where} belongs to the {before.value} model and is now declared {own.value}: "
                                f"one module shared by two roles would replay for both; build a separate model")
            if own is not Role.ACTOR and router.router_replay is not None:
                raise RoleError(f"{where} of the {own.value} model holds {_replay_owner(router.router_replay)}; "
                                f"only the actor replays (miles #2226, NeMo RL #4083, #3903): build the "
                                f"{own.value} with moe_enable_routing_replay=False and attach no Replayer to it")
            setattr(router, ROLE_ATTR, own)
            count += 1
        setattr(chunk, ROLE_ATTR, role)
    return count


def check_declared(model_chunks: Sequence[torch.nn.Module] | torch.nn.Module, role: Role | str) -> None:
    """Re-check a declared non-actor model before a pass: nothing gave it a replay object since
    (another role's build or a framework's global replay set-up)."""
    declare_role(model_chunks, role)


def check_actor(routers: dict[int, torch.nn.Module], hooks: dict[int, Any]) -> None:
    """Each actor router still carries the actor role and its own hook (``hooks``: layer -> the
    hook the Replayer attached). Called at every replay pass."""
    for layer, router in routers.items():
        role = role_of(router)
        if role is not Role.ACTOR:
            raise RoleError(f"the actor's router of layer {layer} was re-declared {getattr(role, 'value', role)} "
                            f"after the actor's Replayer attached: the {getattr(role, 'value', role)} model shares it")
        if router.router_replay is not hooks[layer]:
            raise RoleError(f"the actor's router of layer {layer} lost its replay hook (now "
                            f"{_replay_owner(router.router_replay) if router.router_replay is not None else 'None'}): "
                            f"a later build or set-up of another role (critic / reference / teacher / MTP) replaced "
                            f"the actor's replay state")


__all__ = ["Role", "ROLE_ATTR", "declare_role", "check_declared", "check_actor", "role_of", "model_role", "model_routers"]
