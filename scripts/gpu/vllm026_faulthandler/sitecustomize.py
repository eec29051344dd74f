"""Every Python process started with this folder on PYTHONPATH (the script and vLLM's engine-core
and worker processes, which inherit the environment) dumps all its threads' stacks to stderr and
exits after ``R3B_FAULT_AFTER`` seconds: the 2026-11-29 run's dump covered the front end only
(waiting in ``core_client.py`` ``get_output``), not the engine core it was waiting for."""
import os

_after = os.environ.get("R3B_FAULT_AFTER")
if _after:
    import faulthandler

    faulthandler.dump_traceback_later(float(_after), exit=True)
