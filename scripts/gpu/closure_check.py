"""Check here, before spending device time, that a GPU script's imports are covered by the device
image plus the wheel sets carried to it (scripts/gpu/bundle.sh).

Runs in the dev virtualenv (Python 3.11, where the same packages are installed) with an import
hook that refuses every top-level module whose distribution is neither on the device image
(scripts/gpu/wheels/image.txt) nor in the named sets, then imports the given modules. A module
imported only inside a function is not seen: this catches the module-level closure, which is where
every earlier device failure came from (fastapi -> opentelemetry, 2026-11-26). Run it from the
repository root (testlab/ is imported from there).

  python scripts/gpu/closure_check.py --sets base te ray verl -- r3bridge.adapters.verl.main_ppo ...
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.metadata as md
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
OWN = {"r3bridge", "testlab", "adapters", "tests", "benchmarks", "scripts"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def allowed_distributions(sets: list[str]) -> set[str]:
    names: set[str] = set()
    for s in ["image", *sets]:
        with open(os.path.join(HERE, "wheels", f"{s}.txt")) as f:
            for line in f:
                spec = line.split("#")[0].strip()
                if not spec or spec.startswith("file:"):
                    if spec:  # file:.../NAME-VERSION-....whl
                        names.add(_norm(os.path.basename(spec).split("-")[0]))
                    continue
                names.add(_norm(spec.removeprefix("build:").split("==")[0].split(">=")[0]))
    return names


class _Hide:
    """Wraps every finder on sys.meta_path so that a module the device would lack is *absent*
    (``importlib.util.find_spec`` returns None, ``import`` raises ModuleNotFoundError), exactly as
    an optional import sees it there."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.owners = {top: [_norm(d) for d in ds] for top, ds in md.packages_distributions().items()}
        self.hidden: dict[str, list[str]] = {}

    def hides(self, fullname: str) -> bool:
        top = fullname.split(".")[0]
        if top in sys.stdlib_module_names or top in OWN:
            return False
        owners = self.owners.get(top)
        if owners and not any(o in self.allowed for o in owners):
            self.hidden.setdefault(top, owners)
            return True
        return False

    def install(self) -> None:
        sys.meta_path[:] = [_Filtered(f, self) for f in sys.meta_path]


class _Filtered(importlib.abc.MetaPathFinder):
    def __init__(self, inner, hide: _Hide) -> None:  # noqa: ANN001
        self.inner, self.hide = inner, hide

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if self.hide.hides(fullname):
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find else None

    def __getattr__(self, name: str):  # invalidate_caches, find_distributions, ...
        return getattr(self.inner, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", nargs="+", required=True)
    ap.add_argument("modules", nargs="+")
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())  # testlab/ and the checkout, as on the device
    hide = _Hide(allowed_distributions(args.sets))
    hide.install()
    failed = 0
    for m in args.modules:
        try:
            importlib.import_module(m)
            print(f"ok      {m}")
        except Exception as e:  # noqa: BLE001 - report every module, then fail
            failed += 1
            print(f"FAILED  {m}: {type(e).__name__}: {e}")
            print("".join(traceback.format_exc().splitlines(keepends=True)[-6:]))
    for top, owners in sorted(hide.hidden.items()):  # looked up at least once (maybe optional)
        print(f"absent on the device: {top} (distribution {', '.join(owners)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
