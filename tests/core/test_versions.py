"""One version helper: ranges read back from r3bridge's installed metadata (the extras in
pyproject.toml), compared with ``packaging``; framework internals checked with a clear ConfigError."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from r3bridge.errors import ConfigError
from r3bridge.versions import check_internals, check_release, release_series, supported_range

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_ranges() -> dict[str, SpecifierSet]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out: dict[str, SpecifierSet] = {}
    for reqs in extras.values():
        for line in reqs:
            r = Requirement(line)
            out[r.name] = out.get(r.name, SpecifierSet()) & r.specifier
    return out


@pytest.mark.parametrize("dist", ["verl", "skyrl", "areal", "megatron-core"])
def test_ranges_are_the_extras_of_pyproject(dist):
    # the installed metadata is what pyproject declares: one source for the ranges
    assert supported_range(dist) == _pyproject_ranges()[dist]


@pytest.mark.parametrize("dist, version", [("verl", "0.9.1"), ("verl", "0.9.2rc1"), ("verl", "0.9.0+local"),
                                           ("skyrl", "0.4.0rc2"), ("areal", "1.0.4"),
                                           ("megatron-core", "0.19.2")])
def test_supported_versions_pass_prereleases_included(dist, version):
    assert str(check_release(dist, version)) == version


@pytest.mark.parametrize("dist, version", [("verl", "0.10.0"), ("verl", "0.8.9"), ("verl", "0.10.0rc1"),
                                           ("areal", "1.1.0"), ("skyrl", "0.5.0"), ("megatron-core", "0.20.0")])
def test_unsupported_versions_name_installed_and_range(dist, version):
    with pytest.raises(ConfigError) as ei:
        check_release(dist, version)
    assert version in str(ei.value) and str(supported_range(dist)) in str(ei.value)


def test_installed_frameworks_are_in_range():
    for dist in ("verl", "skyrl", "areal", "megatron-core"):
        check_release(dist)            # the installed ones (None when one is absent)


def test_release_series_keeps_prereleases():
    assert release_series("0.3.1rc2") == "0.3" and release_series("0.4.0+local") == "0.4"


def test_skyrl_release_uses_the_helper():
    from r3bridge.adapters.skyrl._compat import skyrl_release
    assert skyrl_release("0.3.0") == "0.3" and skyrl_release("0.4.0rc1") == "0.4"
    with pytest.raises(ConfigError, match=re.escape("skyrl<0.5,>=0.3")):
        skyrl_release("0.5.0")


def test_a_supported_release_outside_the_adapters_series_is_refused_naming_them(monkeypatch):
    """supported_series: the range and the adapter's known series must agree; a series in the
    range the adapter does not know is refused naming what it knows (adapters/skyrl/requirements.py'
    one-line form is checked alongside: every unmet requirement, in order)."""
    from r3bridge import versions
    from r3bridge.adapters.skyrl import requirements as req

    monkeypatch.setattr(versions, "supported_range", lambda d, package=None: SpecifierSet(">=0.3,<0.6"))
    assert versions.supported_series("skyrl", "0.4.2", ("0.3", "0.4"), what="'s X", knows="the format of X") == "0.4"
    with pytest.raises(ConfigError, match=re.escape("knows the format of X 0.3.x and 0.4.x only")):
        versions.supported_series("skyrl", "0.5.0", ("0.3", "0.4"), what="'s X", knows="the format of X")
    needs = [req.Requirement("a future Python", python=(99, 0)), req.Requirement("json", module="json"),
             req.Requirement("no such module", module="r3bridge_no_such_module")]
    assert req.unmet(needs, lead="X cannot start", remedy="Fix it.") == \
        "X cannot start: a future Python; no such module. Fix it."
    assert req.unmet(needs[1:2], lead="X", remedy="") is None


def test_missing_internals_name_the_attribute_version_and_range():
    class Registry:
        _engines: dict = {}

    check_internals("verl", [("EngineRegistry._engines", Registry, "_engines")])
    with pytest.raises(ConfigError) as ei:
        check_internals("verl", [("EngineRegistry._engines", object(), "_engines"),
                                 ("main.__wrapped__", object(), "__wrapped__")])
    msg = str(ei.value)
    assert "EngineRegistry._engines" in msg and "main.__wrapped__" in msg and str(supported_range("verl")) in msg


def test_verl_internals_the_adapter_relies_on_exist():
    import verl.trainer.main_ppo as verl_main
    from verl.workers.engine.base import EngineRegistry

    check_internals("verl", [("EngineRegistry._engines", EngineRegistry, "_engines"),
                             ("main.__wrapped__", verl_main.main, "__wrapped__")])


def test_no_hand_split_version_parsing():
    """Versions are compared with packaging, never by splitting strings or int tuples by hand."""
    pattern = re.compile(r"version\w*\s*\.split\(|version\(\)\s*[<>]=?\s*\(|\bv\s*[<>]=?\s*(MIN|MAX)_")
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in ("r3bridge", "adapters") for p in (ROOT / base).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
