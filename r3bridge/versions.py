"""Which framework releases r3bridge supports, read from r3bridge's own installed metadata.

The supported ranges are the extras' requirements in ``pyproject.toml`` (one extra per adapter): :func:`supported_range` reads them back at run time through
``importlib.metadata.requires("r3bridge")``, so pyproject stays the one place they are written.
Versions are compared with :mod:`packaging` (pre-releases and local versions included), never by
splitting strings by hand. :func:`check_release` and :func:`check_internals` turn what is
installed into a :class:`~r3bridge.errors.ConfigError` naming the installed version and the
supported range; :func:`import_skipping_inits` imports a framework's module when one of its
package ``__init__`` chains cannot import here.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from typing import Any, Callable, Iterable, Optional, Sequence

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from r3bridge.errors import ConfigError

__all__ = ["supported_range", "installed_version", "check_release", "release_series", "check_internals",
           "checked_subclass", "import_skipping_inits"]

PACKAGE = "r3bridge"


def supported_range(distribution: str, *, package: str = PACKAGE) -> SpecifierSet:
    """The version range of ``distribution`` that ``package``'s extras declare (the intersection
    when several extras name it). ``ConfigError`` when no extra names it or ``package`` is not
    installed (r3bridge must be installed, editable or not, for its metadata to exist)."""
    try:
        lines = importlib.metadata.requires(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"{package} is not installed (pip install -e . from the checkout): its supported "
                          f"framework ranges are read from its metadata") from None
    want = canonicalize_name(distribution)
    found = [Requirement(line) for line in lines]
    specs = [r.specifier for r in found if canonicalize_name(r.name) == want]
    if not specs:
        raise ConfigError(f"{package}'s metadata declares no supported range for {distribution!r}")
    out = SpecifierSet()
    for s in specs:
        out &= s
    return out


def installed_version(distribution: str) -> Optional[str]:
    """The installed version string of ``distribution``, ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_release(distribution: str, version: Optional[str] = None, *, what: str = "") -> Optional[Version]:
    """``ConfigError`` unless ``version`` (default: the installed one) lies in the supported range;
    ``None`` when the distribution is not installed and no version was given. Pre-releases of a
    supported release are accepted (``0.9.2rc1`` is in ``>=0.9,<0.10``)."""
    if version is None:
        version = installed_version(distribution)
        if version is None:
            return None
    spec = supported_range(distribution)
    try:
        v = Version(version)
    except InvalidVersion:
        raise ConfigError(f"{distribution} reports version {version!r}, which is not a valid version; "
                          f"r3bridge{what} supports {distribution}{spec}") from None
    if not spec.contains(v, prereleases=True):
        raise ConfigError(f"{distribution} {version} is installed; r3bridge{what} supports {distribution}{spec} "
                          f"(the adapter relies on internals of exactly those releases)")
    return v


def release_series(version: Version | str) -> str:
    """``"0.3"`` for ``0.3.0``, ``0.3.1rc2`` or ``0.3.0+local``: the major.minor release."""
    v = version if isinstance(version, Version) else Version(version)
    return f"{v.major}.{v.minor}"


def check_internals(distribution: str, requirements: Iterable[tuple[str, Any, str]]) -> None:
    """Check the framework internals an adapter relies on: each ``(name, owner, attribute)`` must
    have ``getattr(owner, attribute)``. ``ConfigError`` listing every one that is missing, with the
    installed version and the supported range (a release outside it, or a patched install)."""
    missing = [name for name, owner, attribute in requirements if not hasattr(owner, attribute)]
    if missing:
        version = installed_version(distribution) or "(not installed)"
        raise ConfigError(f"{distribution} {version}: r3bridge's adapter relies on {', '.join(missing)}, which this "
                          f"install lacks; r3bridge supports {distribution}{supported_range(distribution)}")


def checked_subclass(distribution: str, name: str, mixin: type, base: type, methods: Sequence[str],
                     attrs: Optional[dict[str, Any]] = None) -> type:
    """``class name(mixin, base)`` (with ``attrs``), after :func:`check_internals` found every one
    of ``methods`` (those ``mixin`` overrides) on the framework's ``base``."""
    check_internals(distribution, [(f"{base.__name__}.{m}", base, m) for m in methods])
    return type(name, (mixin, base), dict(attrs or {}))


def import_skipping_inits(name: str, packages: Sequence[str], *,
                          when: Callable[[BaseException], bool] = lambda e: isinstance(e, ImportError),
                          skipped: Optional[Callable[[], None]] = None) -> types.ModuleType:
    """``importlib.import_module(name)``; if that fails with an error ``when`` accepts (a package
    ``__init__`` that imports what the adapter never uses and this environment cannot import),
    each of ``packages`` whose own import fails is registered as a bare package pointing at its
    real directory (its ``__init__`` skipped, every submodule the framework's own file), and the
    import is retried (after ``skipped()``: what a skipped ``__init__`` would have set up). Anything
    else is raised; a failed retry is raised from the first error (the cause a user can act on)."""
    try:
        return importlib.import_module(name)
    except Exception as first:  # noqa: BLE001 - ``when`` decides
        if not when(first):
            raise
        root = packages[0].split(".")[0]
        for package in packages:
            _drop_failed(root)
            try:
                importlib.import_module(package)
            except Exception:  # noqa: BLE001 - this package's __init__ is in the failing chain
                _drop_failed(root)
                _bare_package(package)
        if skipped is not None:
            skipped()
        try:
            return importlib.import_module(name)
        except ImportError as again:
            raise again from first


def _drop_failed(root: str) -> None:
    """Forget the ``None`` entries a failed import leaves under ``root`` in ``sys.modules``."""
    for mod in [m for m in list(sys.modules) if m == root or m.startswith(root + ".")]:
        if sys.modules.get(mod) is None:
            del sys.modules[mod]


def _bare_package(name: str) -> None:
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None) is not None and not hasattr(mod, "__r3bridge_shim__"):
        return                                   # the real package imported fine earlier
    spec = importlib.util.find_spec(name.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name.split('.')[0]} is not installed")
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(list(spec.submodule_search_locations)[0], *name.split(".")[1:])]
    package.__package__ = name
    package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package.__spec__.submodule_search_locations = list(package.__path__)
    package.__r3bridge_shim__ = True            # type: ignore[attr-defined]
    sys.modules[name] = package


def supported_series(distribution: str, version: Optional[str], series: Sequence[str], *, what: str,
                     knows: str) -> Optional[str]:
    """The ``major.minor`` series (:func:`release_series`) of ``version`` (default: the installed one)
    after :func:`check_release`; ``None`` when not installed. ``ConfigError`` unless it is one of
    ``series``, the releases whose ``knows`` (e.g. "the route transport of X") the adapter has:
    the supported range and the adapter's code must agree."""
    checked = check_release(distribution, version, what=what)
    if checked is None:
        return None
    release = release_series(checked)
    if release not in series:
        raise ConfigError(f"{distribution} {version or checked} is installed; r3bridge{what} knows {knows} "
                          f"{' and '.join(r + '.x' for r in series)} only")
    return release
