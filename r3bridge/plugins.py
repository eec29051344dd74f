"""Installed adapters: the ones r3bridge ships and the ones other packages announce.

An adapter is an ordinary Python package, in r3bridge's tree or anywhere else (``r3bridge
new-adapter NAME`` writes one: docs/porting.md). A package announces its adapter in the
:data:`ENTRY_POINT_GROUP` entry-point group of its distribution, name -> module::

    [project.entry-points."r3bridge.adapters"]
    myfw = "myfw"

``r3bridge adapters`` lists them. Nothing is imported to list them (an adapter imports its
framework lazily, and a broken one must not hide the others).
"""
from __future__ import annotations

import importlib.util
import pkgutil
from dataclasses import dataclass
from importlib.metadata import entry_points

__all__ = ["ENTRY_POINT_GROUP", "SHIPPED_ADAPTERS", "AdapterEntry", "installed_adapters"]

ENTRY_POINT_GROUP = "r3bridge.adapters"


SHIPPED_PACKAGE = "r3bridge.adapters"


def _shipped_adapters() -> dict[str, str]:
    """name -> module of the adapters in r3bridge's own ``adapters/`` folder (the packages there,
    the template left out), found on disk: nothing of the adapters is imported (the core never
    imports an adapter)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    return {m.name: f"{SHIPPED_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(where)
            if m.ispkg and not m.name.startswith("_")}


SHIPPED_ADAPTERS = _shipped_adapters()


@dataclass(frozen=True)
class AdapterEntry:
    """One installed adapter: its name, the module to import, and where it comes from
    (``"r3bridge"`` for the shipped ones, else the distribution that announces it)."""

    name: str
    module: str
    origin: str


def installed_adapters() -> list[AdapterEntry]:
    """The shipped adapters, then every ``r3bridge.adapters`` entry point of the environment
    (sorted by name; a shipped adapter's own entry point is not listed twice)."""
    found = [AdapterEntry(name, module, "r3bridge") for name, module in SHIPPED_ADAPTERS.items()]
    seen = {(e.name, e.module) for e in found}
    announced = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if (ep.name, ep.value) in seen:
            continue
        seen.add((ep.name, ep.value))
        dist = getattr(ep, "dist", None)
        announced.append(AdapterEntry(ep.name, ep.value, dist.metadata["Name"] if dist is not None else "?"))
    return found + sorted(announced, key=lambda e: (e.name, e.module))
