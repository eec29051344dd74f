"""Every import of r3bridge's own names written inside a function body resolves.

Those imports run only when the function does (a launcher's step, a worker's hook), so moving or
renaming a core name breaks them silently: on 2026-11-27 a moved module left
``from r3bridge import ray_watch`` inside a launcher function, and every verl launch failed at
its first call. Read from the source (nothing runs): each ``from r3bridge... import NAME`` under a
``def`` of ``r3bridge/`` and ``adapters/`` must name a module, or a name the module defines.
Imports of the frameworks themselves (verl, skyrl, areal, megatron) are out of scope: they are
lazy because the framework may be absent."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"r3bridge": REPO / "r3bridge", "r3bridge.adapters": REPO / "adapters"}   # the package dir mapping


def _deferred_imports():
    """(file, line, module, name) of every ``from r3bridge... import name`` inside a function
    (r3bridge writes no relative imports inside functions)."""
    for root in ROOTS.values():
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                            and (node.module == "r3bridge" or node.module.startswith("r3bridge.")):
                        for alias in node.names:
                            yield path.relative_to(REPO), node.lineno, node.module, alias.name


def broken_imports() -> tuple[int, list[str]]:
    """(how many deferred imports were read, the ones that do not resolve)."""
    found, broken = 0, []
    for where, line, module, name in sorted(set(_deferred_imports())):
        found += 1
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").startswith("r3bridge"):
                broken.append(f"{where}:{line}: from {module} import {name}: {e}")
            continue                # else: the module needs a framework that is not installed here
        except ImportError:
            continue                # a framework's own import failure, not a moved name
        if hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError as e:
            if (e.name or "").startswith("r3bridge"):
                broken.append(f"{where}:{line}: from {module} import {name}: no such name or module")
    return found, broken


def test_every_deferred_r3bridge_import_resolves():
    # a fresh interpreter: importing every module named (the demo's engines, the frameworks' hooks)
    # must not change the environment of the tests that share this worker
    p = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    found = int(p.stdout.split()[0])
    assert found > 40, p.stdout       # the walk reads the tree (59 such imports on 2026-11-27)


if __name__ == "__main__":
    n, bad = broken_imports()
    print(n, "deferred r3bridge imports read")
    for line in bad:
        print(line)
    raise SystemExit(1 if bad else 0)
