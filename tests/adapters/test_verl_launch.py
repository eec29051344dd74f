"""Replay is on exactly when asked, on both verl launchers, or the launch is refused before Ray starts.

Issue 50: ``python -m verl.trainer.main_ppo ... +r3bridge.replay_mode=R3`` ran the whole job to exit 0
with replay off (nothing read the section); a bad ``R3BRIDGE_REPLAY_MODE`` failed 42 s in, after Ray
started, without naming the variable; ``ray_kwargs.ray_init.num_cpus=2`` hung. Each launch here is the
user's real command line in a fresh interpreter; each must end with exit status 2 and one ``error:``
line before Ray starts (no ``ray init`` line, no Ray session). The way of asking that r3bridge's
launcher honours with a whole job (a ``r3bridge.*`` override) is tests/adapters/test_verl_e2e.py's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r3bridge.adapters.verl.stock_launch import asked_for_r3bridge, verl_entry_point
from r3bridge.config import check_environment
from r3bridge.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
STOCK = ["-m", "verl.trainer.main_ppo"]
OURS = ["-m", "r3bridge.adapters.verl.main_ppo"]
# a verl job config of the user's: verl's own defaults plus an r3bridge section
USER_YAML = """hydra:
  searchpath:
    - pkg://verl.trainer.config
defaults:
  - ppo_trainer
  - _self_
r3bridge:
  {key}: R3
"""


def launch(module: list[str], args: list[str], tmp_path: Path, **env_vars: str) -> tuple[int, str, float]:
    """(exit status, stdout + stderr, seconds) of ``python <module> <args>`` from the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("R3BRIDGE_")}
    env.update(env_vars, OMP_NUM_THREADS="1", RAY_ADDRESS="")
    t = time.monotonic()
    p = subprocess.run([sys.executable, *module, *args, f"hydra.run.dir={tmp_path}/run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t


def refused_before_ray(rc: int, out: str) -> list[str]:
    """The ``error:`` lines of a launch that ended before Ray started."""
    assert rc == 2, out[-3000:]
    assert "ray init kwargs" not in out and "Started a local Ray instance" not in out, out[-3000:]
    return [line for line in out.splitlines() if line.startswith("error: ")]


def user_config(tmp_path: Path, key: str = "replay_mode") -> list[str]:
    (tmp_path / "myjob.yaml").write_text(USER_YAML.format(key=key))
    return [f"--config-path={tmp_path}", "--config-name=myjob"]


# ------------------------------------------------------------------------------ verl's own launcher
@pytest.mark.slow
@pytest.mark.parametrize("way", ["override", "yaml", "environment"])
def test_verl_stock_launcher_asked_for_replay_is_refused_naming_r3bridges_launcher(way, tmp_path):
    """Each way a user asks verl's stock ``main_ppo`` for replay ends before Ray with the line that
    names r3bridge's launcher (on main: the override ran the job with replay off)."""
    args, env = {"override": (["+r3bridge.replay_mode=R3"], {}),
                 "yaml": (user_config(tmp_path), {}),
                 "environment": ([], {"R3BRIDGE_REPLAY_MODE": "R3"})}[way]
    rc, out, seconds = launch(STOCK, args, tmp_path, **env)
    (line,) = refused_before_ray(rc, out)
    assert "verl.trainer.main_ppo (verl's own launcher) does not read r3bridge's settings" in line
    assert "python -m r3bridge.adapters.verl.main_ppo" in line
    assert {"override": "+r3bridge.replay_mode=R3", "yaml": "an r3bridge section in the job config",
            "environment": "replay_mode=R3 in the environment (R3BRIDGE_REPLAY_MODE)"}[way] in line
    print(f"{way}: refused in {seconds:.1f} s")


# ------------------------------------------------------------------------------ both launchers, bad environment
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["stock", "r3bridge"])
def test_a_bad_r3bridge_environment_is_refused_before_ray_naming_the_variable(launcher, tmp_path):
    """A mistyped variable name and a bad mode, on each launcher: one line naming the variable and
    what it takes (on main: stock ran with replay off / failed after Ray; r3bridge's launcher said
    'replay_mode must be ...' without the variable)."""
    module = STOCK if launcher == "stock" else OURS
    rc, out, _ = launch(module, [], tmp_path, R3BRIDGE_REPLAY_MODE="R4")
    (line,) = refused_before_ray(rc, out)
    assert "R3BRIDGE_REPLAY_MODE='R4'" in line and "off, R2, R3" in line
    if launcher == "stock":
        return
    rc, out, _ = launch(module, [], tmp_path, R3BRIDGE_REPLAY_MDOE="R3")
    (line,) = refused_before_ray(rc, out)
    assert "R3BRIDGE_REPLAY_MDOE is not an r3bridge setting" in line and "R3BRIDGE_REPLAY_MODE" in line


# ------------------------------------------------------------------------------ r3bridge's launcher
@pytest.mark.slow
def test_r3bridge_launcher_reads_a_yaml_section_and_lists_the_valid_keys_of_a_typo(tmp_path):
    """A mistyped key of the user's YAML section is refused before verl is imported, with every
    valid key (the section is read: a YAML section on r3bridge's launcher is honoured)."""
    rc, out, _ = launch(OURS, user_config(tmp_path, key="replay_mod"), tmp_path)
    (line,) = refused_before_ray(rc, out)
    assert "unknown r3bridge option(s) ['replay_mod']" in line and "'replay_mode'" in line and "'trace_dir'" in line


@pytest.mark.slow
def test_r3bridge_launcher_refuses_too_few_ray_cpu_slots_with_the_numbers(tmp_path):
    """Issue 50 item 2: the CPU rehearsal's shape with ``num_cpus=2`` (the old check counted only
    TransferQueue's 2 slots, and the job hung on the worker group's {CPU: 3, GPU: 1} bundle)."""
    rc, out, seconds = launch(OURS, ["ray_kwargs.ray_init.num_cpus=2", "trainer.n_gpus_per_node=1",
                                     "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
                                     "r3bridge.replay_mode=R3"], tmp_path)
    (line,) = refused_before_ray(rc, out)
    assert "verl would hold 5 Ray CPU slots" in line and "gets 2 from ray_kwargs.ray_init.num_cpus" in line
    assert "ray_kwargs.ray_init.num_cpus=5 or more" in line
    print(f"refused in {seconds:.1f} s")


# ------------------------------------------------------------------------------ the detection itself (in process)
def test_which_processes_are_verls_entry_points():
    assert verl_entry_point(["python", "-u", "-m", "verl.trainer.main_ppo", "a=1"]) == ("verl.trainer.main_ppo", ["a=1"])
    assert verl_entry_point(["python", "-X", "dev", "-W", "error", "-m", "verl.trainer.main_ppo", "-m", "a=1,2"]) == \
        ("verl.trainer.main_ppo", ["-m", "a=1,2"])
    assert verl_entry_point(["python", "/x/site-packages/verl/trainer/main_ppo.py", "b=2"]) == \
        ("verl.trainer.main_ppo", ["b=2"])
    assert verl_entry_point(["python", "-m", "verl.experimental.fully_async_policy.fully_async_main"]) is not None
    for argv in (["python", "-m", "r3bridge.adapters.verl.main_ppo", "r3bridge.replay_mode=R3"],
                 ["python", "-c", "import verl"], ["python", "/x/ray/_private/workers/default_worker.py"],
                 ["python", "-m", "pytest"], ["python", "-m", "verl.model_merger", "merge"]):
        assert verl_entry_point(argv) is None, argv


def test_every_spelling_of_asking_is_seen_and_asking_for_off_in_the_environment_is_not():
    m = "verl.trainer.main_ppo"
    for arg in ("r3bridge.replay_mode=R3", "+r3bridge.trace_dir=/t", "++r3bridge={replay_mode: R2}",
                "+ray_kwargs.ray_init.runtime_env.env_vars.R3BRIDGE_CONFIG={}"):
        assert asked_for_r3bridge(m, ["trainer.n_gpus_per_node=1", arg], environ={}) == [arg]
    assert asked_for_r3bridge(m, ["trainer.r3bridge_like=1", "data.x=r3bridge.y"], environ={}) == []
    assert asked_for_r3bridge(m, [], environ={"R3BRIDGE_REPLAY_MODE": "off"}) == []
    # the section r3bridge's launcher forwards to what it starts is not a user's request
    assert asked_for_r3bridge(m, [], environ={"R3BRIDGE_CONFIG": '{"replay_mode": "R3"}',
                                              "R3BRIDGE_CONFIG_FROM": "verl launcher"}) == []
    assert asked_for_r3bridge(m, [], environ={"R3BRIDGE_CONFIG": '{"replay_mode": "R2"}'}) == [
        "replay_mode=R2 in the environment (R3BRIDGE_CONFIG)"]


def test_check_environment_names_each_bad_variable():
    check_environment({"R3BRIDGE_REPLAY_MODE": "R3", "R3BRIDGE_CONFIG": '{"trace_dir": "/t"}', "PATH": "/bin"})
    with pytest.raises(ConfigError) as e:
        check_environment({"R3BRIDGE_REPLAY_MODE": "R5", "R3BRIDGE_CONFG": "{}", "R3BRIDGE_CONFIG": '{"x": 1}'})
    msg = str(e.value)
    assert "R3BRIDGE_CONFG is not an r3bridge setting" in msg and "R3BRIDGE_REPLAY_MODE='R5'" in msg
    assert "R3BRIDGE_CONFIG: unknown r3bridge option(s) ['x']; known: [" in msg
    with pytest.raises(ConfigError, match="disagree"):
        check_environment({"R3BRIDGE_REPLAY_MODE": "R2", "R3BRIDGE_CONFIG": '{"replay_mode": "R3"}'})


# ------------------------------------------------------------------------------ a job Ray cannot place, once running
def test_a_stage_ray_cannot_place_is_said_after_the_blocked_bound_not_the_stall_bound():
    """The watchdog's early line: Ray says what it cannot place for ``blocked_after_s`` in a row ->
    one WARNING for the stage, long before the slow-stage bound; a blockage that clears resets."""
    from r3bridge.adapters.verl.watch import Stage, StallWatchdog

    now, why = [0.0], [""]
    stages = [Stage("worker start", "the workers", "engine_ready"), Stage("first replayed pass", "a pass", "first_pass")]
    dog = StallWatchdog("verl launcher", stages, 180, progress=set, blocked=lambda: why[0], blocked_after_s=20,
                        clock=lambda: now[0])
    why[0] = "Cannot be placed until resources free: placement group x (1 x {CPU: 3, GPU: 1})."
    assert dog.check() is None                        # first seen at 0 s
    now[0] = 10.0
    why[0] = ""
    assert dog.check() is None                        # cleared: a momentary state, forgotten
    why[0] = "Cannot be placed until resources free: placement group x (1 x {CPU: 3, GPU: 1})."
    now[0] = 15.0
    assert dog.check() is None
    now[0] = 36.0
    line = dog.check()
    assert "stage 'worker start' (1 of 2) cannot go on: Ray cannot place what the job asked for (21 s so far)" in line
    assert "placement group x (1 x {CPU: 3, GPU: 1})" in line
    now[0] = 60.0
    assert dog.check() is None                        # said once per stage; the slow-stage bound is 180 s
    now[0] = 181.0
    assert "no progress for 181 s in stage 'worker start'" in dog.check()


@pytest.mark.slow
def test_describe_cluster_names_the_placement_group_ray_cannot_place():
    """On a real local Ray cluster of 2 CPU slots, a {CPU: 3, GPU: 1} bundle (verl's worker group) is
    blocked: ``describe_cluster(blocked_only=True)`` names it with its resources and the hint; a
    cluster with nothing pending is not blocked."""
    import ray

    from r3bridge.adapters.verl.main_ppo import RAY_HINTS
    from r3bridge.adapters.verl.watch import describe_cluster

    assert not ray.is_initialized()
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, address="local", log_to_driver=False)
    try:
        assert describe_cluster(RAY_HINTS, blocked_only=True) == ""
        pg = ray.util.placement_group([{"CPU": 3, "GPU": 1}], name="global_pool_0")
        deadline = time.monotonic() + 60
        while not (why := describe_cluster(RAY_HINTS, blocked_only=True)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "Ray cluster: CPU 2 (free 2), GPU 1 (free 1)" in why
        assert "placement group global_pool_0 (1 x {CPU: 3, GPU: 1}) asks for {CPU: 3, GPU: 1}" in why
        assert "ray_kwargs.ray_init.num_cpus=N" in why
        ray.util.remove_placement_group(pg)
    finally:
        ray.shutdown()


_ANNOUNCE = (
    "import logging, sys\n"
    "from r3bridge.announce import announce, ensure_visible\n"
    "from r3bridge.config import ReplayConfig\n"
    "ensure_visible()\n"                                   # the adapter's import, before any logging set-up
    "announce(ReplayConfig(), 'default', 'first')\n"
    "logging.basicConfig(format='ROOT %(levelname)s:%(message)s', stream=sys.stderr)\n"   # then the framework's
    "announce(ReplayConfig(replay_mode='R3'), 'config', 'second')\n"
)


def test_off_is_said_at_warning_level_and_each_line_once():
    """'off' printed by r3bridge's own handler carries its level (issue 50: Python's last-resort
    handler printed it bare); once the framework configures the root logger, each line is printed
    once, by the framework's handler (hydra's printed every launcher line twice)."""
    p = subprocess.run([sys.executable, "-c", _ANNOUNCE], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("R3BRIDGE_")})
    lines = [ln for ln in p.stderr.splitlines() if "r3bridge (" in ln]
    assert len(lines) == 2, p.stderr
    assert " r3bridge WARNING: r3bridge (first, pid " in lines[0] and "routing replay is OFF" in lines[0]
    assert lines[1].startswith("ROOT INFO:r3bridge (second, pid ") and "replay_mode=R3" in lines[1]
