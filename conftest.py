"""Repository-root pytest set-up: the test lab (``testlab/``, not shipped) must import in every
process a test starts: multiprocessing's spawned ranks inherit ``sys.path``, but subprocesses and
Ray workers only see ``PYTHONPATH``."""

import os

_ROOT = os.path.dirname(os.path.abspath(__file__))
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if _ROOT not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *_paths])
