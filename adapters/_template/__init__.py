"""Template: r3bridge for <YourFramework>. Copy this folder to ``adapters/<yourframework>/``.

A working skeleton for a toy framework whose training batch is a dict of padded ``[B, S, ...]``
tensors (``tests/adapters/test_template.py`` runs it through conformance checks 1-5): replace
the parts marked "your framework" with your framework's own formats and methods. Porting =
these files + passing ``r3bridge.testing.conformance`` (docs/porting.md). Rules:

* import ``r3bridge`` only, never another adapter, and import the framework lazily;
* subclass or wrap the framework's classes; never monkey-patch a class or module attribute;
* never infer anything from a length: layer ids, coverage and validity are explicit fields;
* every problem raises a ``r3bridge.ReplayError`` subclass (ConfigError for set-up problems);
* the reference model never replays; R2 updates replay only routes with ``source="recorded"``.

Files, in the order data flows (the same in every adapter):

* ``config.py`` - the ``r3bridge`` section (:func:`replay_config`);
* ``rollout.py`` - :class:`TemplateRollout`, the :class:`r3bridge.protocols.RolloutIngest`:
  engine calls of each sample -> ReplayBatch, stitched first-seen;
* ``codec.py`` - :class:`TemplateCodec`, the :class:`r3bridge.protocols.BatchCodec`: the
  training batch <-> ReplayBatch;
* ``hooks.py`` - :class:`TemplateEngineMixin`: the framework method that runs Megatron's
  schedule, wrapped in :class:`r3bridge.megatron.PhaseRunner`.
"""
from __future__ import annotations

from r3bridge.adapters._template.codec import RECORDED_KEY, ROUTES_KEY, SAMPLE_KEY, TemplateCodec
from r3bridge.adapters._template.config import replay_config
from r3bridge.adapters._template.hooks import TemplateEngineMixin
from r3bridge.adapters._template.rollout import TemplateRollout

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "TemplateCodec", "TemplateRollout", "TemplateEngineMixin",
           "replay_config"]
