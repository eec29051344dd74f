"""Shared helpers of the benchmark scripts (not a test, not part of the package)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import sys
import types
import warnings
from pathlib import Path
from unittest import mock

import torch

# The checkout these scripts sit in is what they measure, whatever r3bridge the interpreter has
# installed (an editable install of another worktree, a wheel): its root goes first on the path.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), or None outside git."""
    import subprocess
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def machine_info() -> dict:
    info = {
        "commit": _commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    from importlib import metadata
    for dist in ("megatron-core", "verl", "skyrl", "numpy"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return info


@contextlib.contextmanager
def parallel_state(*, tp: int = 1, cp: int = 1, cp_rank: int = 0):
    """Answer megatron parallel_state's size/rank getters (read by verl and SkyRL packers)
    without a process group."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(ps, "get_tensor_model_parallel_world_size", return_value=tp))
        st.enter_context(mock.patch.object(ps, "get_context_parallel_world_size", return_value=cp))
        st.enter_context(mock.patch.object(ps, "get_context_parallel_rank", return_value=cp_rank))
        yield


def load_skyrl_replay_utils():
    """Load ``skyrl/backends/skyrl_train/utils/replay_utils.py`` from the installed skyrl 0.3.0
    wheel without running ``skyrl/__init__.py`` (it fails to import on Python 3.11: pydantic
    refuses ``typing.TypedDict``).

    Stubbed: only the *package* modules ``skyrl``, ``skyrl.backends``,
    ``skyrl.backends.skyrl_train``, ``...distributed``, ``...distributed.megatron`` and
    ``...utils`` (empty modules whose ``__path__`` points at the real folders, so no package
    ``__init__`` runs). ``packing_utils.py`` (what replay_utils imports) and ``replay_utils.py``
    themselves are the real files, loaded with ``spec_from_file_location``.
    """
    spec = importlib.util.find_spec("skyrl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("skyrl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    train = root / "backends" / "skyrl_train"
    pkgs = {
        "skyrl": root,
        "skyrl.backends": root / "backends",
        "skyrl.backends.skyrl_train": train,
        "skyrl.backends.skyrl_train.distributed": train / "distributed",
        "skyrl.backends.skyrl_train.distributed.megatron": train / "distributed" / "megatron",
        "skyrl.backends.skyrl_train.utils": train / "utils",
    }
    _stub_packages(pkgs)
    _load_file("skyrl.backends.skyrl_train.distributed.megatron.packing_utils",
               pkgs["skyrl.backends.skyrl_train.distributed.megatron"] / "packing_utils.py")
    return _load_file("skyrl.backends.skyrl_train.utils.replay_utils",
                      pkgs["skyrl.backends.skyrl_train.utils"] / "replay_utils.py")


def load_verl_router_replay_utils():
    """``verl.utils.megatron.router_replay_utils`` (verl 0.9.1's R2/R3 helpers: ``pp_gather``).

    Where verl imports normally (this machine, after ``make install``) this is a plain import.
    The GPU image has no ray, and ``verl/__init__.py`` -> ``verl.protocol`` imports ray although
    ``pp_gather`` never uses it; there the *package* modules ``verl``, ``verl.models`` and
    ``verl.models.mcore`` are stubbed (empty modules whose ``__path__`` points at the real
    folders, as for SkyRL above) and ``router_replay_utils.py`` with everything it imports is
    the real verl code (it needs omegaconf and tensordict, carried as wheels: docs/gpu.md).
    """
    try:
        from verl.utils.megatron import router_replay_utils
        return router_replay_utils
    except ImportError as e:
        if "ray" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]   # the half-imported package of the failed attempt
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    for name, path in {"verl": root, "verl.models": root / "models",
                       "verl.models.mcore": root / "models" / "mcore"}.items():
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        sys.modules[name] = m
    return importlib.import_module("verl.utils.megatron.router_replay_utils")


def _load_file(name: str, path: Path):
    s = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(s)
    sys.modules[name] = mod
    s.loader.exec_module(mod)
    return mod


def _stub_packages(pkgs: dict[str, Path]) -> None:
    for name, path in pkgs.items():
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [str(path)]
            sys.modules[name] = m


def load_skyrl04_preprocess(root: str | os.PathLike):
    """``skyrl/train/dataset/preprocess.py`` of the SkyRL 0.4.0 wheel unpacked at ``root`` (the
    folder holding ``skyrl/``: ``make install`` puts it in ``build/skyrl04``), without any package
    ``__init__`` (they import datasets, transformers and ray). Stubbed: the *package* modules
    only; ``packed_tensor``, ``packing_utils``, ``token_metadata``, ``routed_experts``,
    ``replay_utils``, ``sample_support`` and ``preprocess`` are the wheel's files (they need
    jaxtyping)."""
    sk = Path(root) / "skyrl"
    tr = sk / "backends" / "skyrl_train"
    _stub_packages({"skyrl": sk, "skyrl.backends": sk / "backends", "skyrl.backends.skyrl_train": tr,
                    "skyrl.backends.skyrl_train.utils": tr / "utils",
                    "skyrl.backends.skyrl_train.distributed": tr / "distributed",
                    "skyrl.backends.skyrl_train.distributed.megatron": tr / "distributed" / "megatron",
                    "skyrl.train": sk / "train", "skyrl.train.dataset": sk / "train" / "dataset"})
    for name, path in (("skyrl.backends.skyrl_train.utils.packed_tensor", tr / "utils" / "packed_tensor.py"),
                       ("skyrl.backends.skyrl_train.distributed.megatron.packing_utils",
                        tr / "distributed" / "megatron" / "packing_utils.py"),
                       ("skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
                        tr / "distributed" / "megatron" / "token_metadata.py"),
                       ("skyrl.backends.skyrl_train.utils.routed_experts", tr / "utils" / "routed_experts.py"),
                       ("skyrl.backends.skyrl_train.utils.replay_utils", tr / "utils" / "replay_utils.py"),
                       ("skyrl.backends.skyrl_train.utils.sample_support", tr / "utils" / "sample_support.py")):
        if name not in sys.modules or not hasattr(sys.modules[name], "__file__"):
            _load_file(name, path)
    return _load_file("skyrl.train.dataset.preprocess", sk / "train" / "dataset" / "preprocess.py")


def load_verl_attention_utils():
    """``verl/utils/attention_utils.py`` (``unpad_input`` / ``index_first_axis``, what verl's
    ``left_right_2_no_padding`` calls on ``routed_experts``) by file, without ``verl/__init__``
    (ray) and without ``verl/utils/__init__`` (tokenizers, omegaconf). ``R3BRIDGE_VERL_ROOT``: a
    folder holding ``verl/utils/attention_utils.py`` where verl is not installed (the GPU image)."""
    root = os.environ.get("R3BRIDGE_VERL_ROOT")
    if root:
        path = Path(root) / "verl" / "utils" / "attention_utils.py"
    else:
        spec = importlib.util.find_spec("verl")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("verl is not installed (set R3BRIDGE_VERL_ROOT)")
        path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "attention_utils.py"
    return _load_file("verl_attention_utils_by_file", path)
