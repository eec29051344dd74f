"""The kit, proven on an adapter written the way a new author writes one: ``tests/cli/madeup/`` was
scaffolded with ``r3bridge new-adapter madeupfw`` and filled in for a made-up framework
(``madeup_framework.py``: MoE layers keyed 1-based, layers 1 and 4 of 6 dense, left-padded batches,
aborted calls with ``routes=None``) using only r3bridge's public helpers, none of the kit's
internals. Its own test module passes checks 1-5 with plain pytest in its own folder, as its
author runs it; the kit fits PP2 x VPP2 to the 6-layer model (PP2 x VPP3) and says so first."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from r3bridge.cli.new_adapter import render_files

HERE = Path(__file__).resolve().parent
PROJECT = HERE / "madeup"


def test_the_project_is_what_new_adapter_wrote_where_the_author_left_it_alone():
    written = render_files("madeupfw")
    for rel in ("madeupfw/config.py", "pyproject.toml"):
        assert (PROJECT / rel).read_text() == written[rel], rel
    assert 'framework="madeupfw"' in (PROJECT / "madeupfw" / "hooks.py").read_text()


@pytest.mark.slow
def test_the_made_up_adapter_passes_checks_1_to_5(tmp_path):
    from test_new_adapter import _pytest

    root = tmp_path / "madeup"
    shutil.copytree(PROJECT, root, ignore=shutil.ignore_patterns("__pycache__"))
    run = _pytest(root, "-W", "always::r3bridge.testing.kit.conformance.LayoutNote", timeout=1500)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert re.search(r"\b15 passed\b", out), out[-2000:]     # 3 seeds x 4 ingest tests + checks 4 (two), 5
    assert "2 ranks pp=2 vpp=2" in out and "ran 2 ranks pp=2 vpp=3 instead" in out, out[-3000:]
