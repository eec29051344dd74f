"""r3bridge for AReaL 1.0.x: ``replay_mode: R2 | R3 | off`` on AReaL's Megatron engine.

The files of every adapter (docs/porting.md, "The seam"), plus ``launch.py`` (AReaL's local
launcher after r3bridge's checks). See docs/use-with-areal.md.
"""
from __future__ import annotations

from r3bridge.adapters.areal.codec import ArealCodec
from r3bridge.adapters.areal.config import grpo_config_class
from r3bridge.adapters.areal.hooks import SGLangEngineMixin, WorkflowMixin, trainer_class, workflow_class

__all__ = ["grpo_config_class", "trainer_class", "workflow_class", "WorkflowMixin", "SGLangEngineMixin", "ArealCodec"]
