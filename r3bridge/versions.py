"""Which framework releases r3bridge supports, read from r3bridge's own installed metadata.

The supported ranges are the extras' requirements in ``pyproject.toml`` (``verl>=0.9,<0.10``,
...): :func:`supported_range` reads them back at run time through
``importlib.metadata.requires("r3bridge")``, so pyproject stays the one place they are written.
Versions are compared with :mod:`packaging` (pre-releases and local versions included), never by
splitting strings by hand. :func:`check_release` and :func:`check_internals` turn what is
installed into a :class:`~r3bridge.errors.ConfigError` naming the installed version and the
supported range.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any, Iterable, Optional

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from r3bridge.errors import ConfigError

__all__ = ["supported_range", "installed_version", "check_release", "release_series", "check_internals"]

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
