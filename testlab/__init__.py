"""r3bridge's own framework test lab: not shipped in the wheel.

Runners and fixtures that drive the real verl 0.9.1, SkyRL 0.3 and AReaL 1.0.4 classes on the CPU
harness of :mod:`r3bridge.testing`, plus the cross-framework dispatch records and the HF-engine
checks. They are r3bridge's tests' machinery, not something an adapter author or a user imports:
an adapter author's kit is :mod:`r3bridge.testing`, the demo's rollout engine is
:mod:`r3bridge.demo`.

Importable from the repository root only (pytest's ``pythonpath = ["."]``; the root
``conftest.py`` puts the root on ``PYTHONPATH`` for spawned ranks and Ray workers).
``tests/packaging/test_wheel.py`` fails if any of it is shipped again.
"""
