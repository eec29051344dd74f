"""Template: r3bridge for <YourFramework>, an adapter package of its own, anywhere (``r3bridge
new-adapter NAME`` writes a copy with a pyproject announcing it in the ``r3bridge.adapters``
entry-point group, its conformance tests and a README).

A working skeleton for a toy framework whose training batch is a dict of padded ``[B, S, ...]``
tensors (its conformance test module runs it through checks 1-5 with pytest): replace the parts marked "your framework" with your framework's own formats and
methods. Porting = these files + passing ``r3bridge.testing.kit.conformance`` (docs/porting.md).
The files import each other relatively, so the package works under any name. Rules:

* import ``r3bridge`` only, never another adapter, and import the framework lazily;
* subclass or wrap the framework's classes; never monkey-patch a class or module attribute;
* "no route" is said explicitly (a validity field, or an in-band value no expert id takes:
  :func:`r3bridge.padded_routes`); never infer it from lengths, and from zeros only through
  :func:`r3bridge.batch.canonical.nonzero_rows` for a transport that has no other way (``codec.py``);
* every problem raises a ``r3bridge.ReplayError`` subclass (ConfigError for set-up problems);
* the reference model never replays; R2 updates replay only routes with ``route_kind="recorded"``.

Files, in the order data flows (the same in every adapter):

* ``config.py`` - the ``r3bridge`` section (:func:`replay_config`);
* ``rollout.py`` - :class:`TemplateRollout`, the :class:`r3bridge.protocols.RolloutIngest`:
  engine calls of each sample -> ReplayBatch, stitched first-seen;
* ``codec.py`` - :class:`TemplateCodec`, the :class:`r3bridge.protocols.BatchCodec`: the
  training batch <-> ReplayBatch;
* ``hooks.py`` - :class:`TemplateEngineMixin`: the framework method that runs Megatron's
  schedule, wrapped in the pass of an :class:`r3bridge.session.AdapterSession` (the driver owns
  the set-up; the adapter hands it one ``MicroBatch`` per micro-batch).
"""
from __future__ import annotations

from .codec import RECORDED_KEY, ROUTES_KEY, SAMPLE_KEY, VALID_KEY, TemplateCodec
from .config import replay_config
from .hooks import TemplateEngineMixin
from .rollout import TemplateRollout

__all__ = ["ROUTES_KEY", "VALID_KEY", "RECORDED_KEY", "SAMPLE_KEY", "TemplateCodec", "TemplateRollout",
           "TemplateEngineMixin", "replay_config"]
