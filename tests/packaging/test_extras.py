"""What pyproject.toml and the README declare about installing r3bridge next to each framework,
checked against the framework releases' own metadata (the installed wheels of the test
environment; SkyRL 0.4's from the files `make install` puts in build/skyrl04)."""
from __future__ import annotations

import os
import re
import tomllib
from importlib.metadata import Distribution, PathDistribution, distribution
from itertools import combinations
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = {name: [Requirement(r) for r in reqs] for name, reqs in PROJECT["project"]["optional-dependencies"].items()}
ADAPTER_EXTRAS = {"verl": "verl", "skyrl": "skyrl", "areal": "areal"}   # extra -> framework distribution
SKYRL04 = Path(os.environ.get("R3BRIDGE_SKYRL04", REPO / "build" / "skyrl04"))


def _release(name: str, version: str) -> Distribution:
    if name == "skyrl" and version == "0.4.0":
        dist = PathDistribution(SKYRL04 / "skyrl-0.4.0.dist-info")
    else:
        dist = distribution(name)
    assert dist.version == version, f"{name} {version} documented, {dist.version} installed"
    return dist


def _base_requirements(dist: Distribution) -> dict[str, SpecifierSet]:
    """The release's own requirements (no extra) on this platform, by name."""
    out = {}
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out[req.name] = req.specifier
    return out


def _some_version_satisfies(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether one version satisfies both: an intersection of such ranges, if not empty, holds one
    of their bounds or the next micro / minor release after one."""
    candidates = set()
    for spec in [*a, *b]:
        v = Version(spec.version.replace(".*", ""))
        major, minor, micro = (list(v.release) + [0, 0])[:3]
        candidates |= {v, Version(f"{major}.{minor}.{micro + 1}"), Version(f"{major}.{minor + 1}.0")}
    return any(v in a and v in b for v in candidates)


def test_every_adapter_extra_and_the_demo_bring_megatron_core():
    (megatron,) = EXTRAS["megatron"]
    for extra in [*ADAPTER_EXTRAS, "demo"]:
        assert megatron in EXTRAS[extra], f"[{extra}] lacks {megatron}"


def test_extras_bring_mbridge_with_what_import_mbridge_needs():
    """mbridge 0.15.1 declares einops and safetensors, which `import mbridge` imports, only under its
    own `megatron` extra: an extra bringing plain `mbridge` left a fresh verl virtualenv without einops
    (scripts/guides_fresh_venv.sh). The installed mbridge's metadata says what that extra holds."""
    import_needs = {Requirement(r).name for r in distribution("mbridge").requires or []
                    if Requirement(r).marker is not None and Requirement(r).marker.evaluate({"extra": "megatron"})}
    assert "einops" in import_needs, import_needs
    for extra, reqs in EXTRAS.items():
        for req in reqs:
            if req.name == "mbridge":
                assert "megatron" in req.extras, f"[{extra}] brings {req}: without mbridge[megatron], no {import_needs}"


def test_no_extra_names_a_torch_build():
    """torch comes only from the core dependency (a range): the extras never pick a build, so a
    machine with the CPU torch keeps it."""
    for extra, reqs in EXTRAS.items():
        assert not [r for r in reqs if r.name == "torch"], extra
    groups = PROJECT["dependency-groups"]
    assert not [r for g in groups.values() for r in g if isinstance(r, str) and Requirement(r).name == "torch"]


def test_declared_conflicts_are_exactly_the_extras_no_environment_can_hold():
    """[tool.uv] conflicts == the adapter extras whose framework releases (installed here) pin
    transformers ranges with no version in common."""
    fw_specs = {extra: _base_requirements(distribution(dist)) for extra, dist in ADAPTER_EXTRAS.items()}
    conflicting = {frozenset((a, b)) for a, b in combinations(sorted(fw_specs), 2)
                   if not _some_version_satisfies(fw_specs[a]["transformers"], fw_specs[b]["transformers"])}
    declared = {frozenset(item["extra"] for item in group) for group in PROJECT["tool"]["uv"]["conflicts"]}
    assert conflicting, "verl 0.9 and AReaL 1.0 pin disjoint transformers ranges: expected a conflict"
    assert declared == conflicting


def _readme_rows() -> list[list[str]]:
    """The README's framework table: '| <Framework> <version> | `pip install ".[extra]"` | `python` | pins |'."""
    rows = []
    for line in (REPO / "README.md").read_text().splitlines():
        m = re.match(r'\|\s*(verl|SkyRL|AReaL) (\d+\.\d+\.\d+)\s*\|(.*)\|\s*$', line)
        if m:
            rows.append([m[1].lower(), m[2], *[c.strip() for c in m[3].split("|")]])
    return rows


def test_readme_states_each_framework_release_requirements_as_its_metadata_does():
    rows = _readme_rows()
    assert {(r[0], r[1]) for r in rows} >= {("verl", "0.9.1"), ("skyrl", "0.3.0"), ("skyrl", "0.4.0"),
                                            ("areal", "1.0.4")}
    for name, version, install, python, pins in rows:
        if name == "skyrl" and version == "0.4.0" and not SKYRL04.exists():
            pytest.fail(f"{SKYRL04} missing: make install puts skyrl 0.4.0's files there")
        dist = _release(name, version)
        assert re.fullmatch(rf'`pip install "\.\[{name}\]"`', install), install
        assert name in EXTRAS
        assert SpecifierSet(python.strip("`")) == SpecifierSet(dist.metadata["Requires-Python"]), (name, version)
        own = _base_requirements(dist)
        stated = [Requirement(p) for p in re.findall(r"`([^`]+)`", pins)]
        assert stated, f"{name} {version}: no requirement stated"
        for req in stated:
            assert own.get(req.name) == req.specifier, (name, version, str(req), str(own.get(req.name)))
        # every torch / transformers pin the release has is stated
        assert {n for n in ("torch", "transformers") if n in own} <= {r.name for r in stated}, (name, version)
