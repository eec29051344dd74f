"""Put last on a job's ``PYTHONPATH`` by :func:`testlab.verl_e2e.stacks_env` (``R3E2E_STACKS_AFTER``):
every Python process of the job (the driver, Ray's workers and helpers, the rollout engine's own
processes, which inherit the environment) appends all its threads' stacks to
``$R3E2E_STACKS_DIR/<pid>.txt`` every ``R3E2E_STACKS_AFTER`` seconds of its life, and keeps running
(the last dump of a hung process shows where it hangs).
It does not exit (unlike ``scripts/gpu/vllm026_faulthandler``): Ray's log monitor is a Python
process too, and the job's own timeout ends a hung job. A process that ends sooner leaves an empty
file."""
import os

_after = os.environ.get("R3E2E_STACKS_AFTER")
_dir = os.environ.get("R3E2E_STACKS_DIR")
if _after and _dir:
    import faulthandler
    import sys

    try:
        os.makedirs(_dir, exist_ok=True)
        _file = open(os.path.join(_dir, f"{os.getpid()}.txt"), "w")   # open for the process's lifetime
        faulthandler.dump_traceback_later(float(_after), repeat=True, exit=False, file=_file)
    except (OSError, ValueError) as exc:     # a diagnostic: say so, never stop the job's process
        print(f"r3e2e stacks: not armed in pid {os.getpid()}: {exc}", file=sys.stderr)
