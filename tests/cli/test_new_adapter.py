"""``r3bridge new-adapter`` end to end: a package written outside the repository, filled in for a
made-up framework, passes conformance checks 1-5 with plain pytest there; a codec that places
the routes one token late fails check 1 with a message naming the sample and the shift."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r3bridge.cli.main import main
from r3bridge.cli.new_adapter import camel_case, render_files

REPO = Path(__file__).resolve().parents[2]

# The made-up framework "toyfw": left-padded batches whose rollout routes sit in "experts",
# every decoder layer, with no validity field: a token without a route is an all-zero row.
TOYFW_BATCH = '''def framework_batch(rollout: CanonicalRollout) -> dict:
    """toyfw's batch: left-padded; "experts" holds every call's routes stitched first-seen, zero
    rows where no call routed a token (toyfw has no validity field)."""
    b, s = rollout.batch_size, max(len(t) for t in rollout.tokens)
    batch = {"input_ids": torch.zeros(b, s, dtype=torch.int64), "attention_mask": torch.zeros(b, s, dtype=torch.bool),
             ROUTES_KEY: torch.zeros(b, s, rollout.num_layers, rollout.topk, dtype=torch.int16)}
    for i, tokens in enumerate(rollout.tokens):
        start = s - len(tokens)
        batch["input_ids"][i, start:] = torch.tensor(tokens)
        batch["attention_mask"][i, start:] = True
        calls = [c for c in rollout.calls[i] if c is not None]     # aborted calls returned no routes
        if calls:
            rows = torch.from_numpy(first_seen_rows(calls)[0].astype("int16"))
            batch[ROUTES_KEY][i, start:start + len(rows)] = rows
    return batch


'''


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path.name}: {old!r} found {text.count(old)} times"
    path.write_text(text.replace(old, new))


def _pytest(root: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m pytest`` in ``root``, as a user there runs it: no repository path in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_new_adapter_outside_the_repo_passes_checks_1_to_5(tmp_path):
    root = tmp_path / "toyfw-adapter"
    assert REPO not in root.parents
    proc = subprocess.run([sys.executable, "-m", "r3bridge.cli.main", "new-adapter", "toyfw", "--dir", str(root)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    package, test = root / "toyfw", root / "tests" / "test_toyfw_conformance.py"
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "codec.py", "config.py", "hooks.py",
                                                         "rollout.py"]
    assert '"r3bridge.adapters"' in (root / "pyproject.toml").read_text() and (root / "README.md").is_file()
    assert "r3bridge.adapters" not in package.joinpath("hooks.py").read_text()    # relative imports only

    # fill it in for toyfw: its field names, no validity field, its batch; checks 1-3 here (checks
    # 4-5 of a scaffolded adapter: test_madeup_adapter.py)
    _edit(package / "codec.py", 'ROUTES_KEY = "routed_experts"', 'ROUTES_KEY = "experts"')
    _edit(package / "codec.py", 'VALID_KEY: Optional[str] = "routed_valid"', "VALID_KEY: Optional[str] = None")
    text = test.read_text()
    start, end = text.index("def framework_batch("), text.index("class ToyEngine")
    test.write_text(text[:start] + TOYFW_BATCH + text[end:])

    run = _pytest(root, "-k", "Ingest", timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\b12 passed\b", run.stdout), run.stdout[-2000:]     # 3 seeds x 4 ingest tests

    # a broken codec: the routes placed one token late
    _edit(package / "codec.py", "        # the engine reports every decoder layer: keep the MoE ones, by id\n",
          "        routes = torch.roll(torch.as_tensor(routes), 1, dims=1)     # broken: one token late\n"
          "        # the engine reports every decoder layer: keep the MoE ones, by id\n")
    broken = _pytest(root, "-k", "check1_ingest", timeout=600)
    assert broken.returncode == 1, broken.stdout[-3000:]
    assert re.search(r"sample 0: routes equal the expected ones shifted by 1 row\b", broken.stdout), \
        broken.stdout[-3000:]
    assert re.search(r"\d of 6 samples shifted by 1 row\b", broken.stdout), broken.stdout[-3000:]


def test_new_adapter_renames_and_refuses_to_overwrite(tmp_path, capsys):
    files = render_files("my_fw")
    assert camel_case("my_fw") == "MyFw"
    assert "class MyFwCodec" in files["my_fw/codec.py"] and "Template" not in files["my_fw/codec.py"]
    assert "from my_fw import" in files["tests/test_my_fw_conformance.py"]
    assert "class TestMyFwMegatron(BaseMegatronTests, MyFwFixtures)" in files["tests/test_my_fw_conformance.py"]
    assert 'my_fw = "my_fw"' in files["pyproject.toml"] and 'name = "r3bridge-my-fw"' in files["pyproject.toml"]
    for text in files.values():
        assert "r3bridge.adapters._template" not in text and "<YourFramework>" not in text and "${" not in text

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert main(["new-adapter", "myfw", "--dir", str(tmp_path / "taken")]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    for bad in ("My-Fw", "class", "_x", "MyFw", "r3bridge_x"):
        assert main(["new-adapter", bad, "--dir", str(tmp_path / "n")]) == 2
        assert "adapter name" in capsys.readouterr().err
    assert not (tmp_path / "n").exists()


def test_adapters_lists_shipped_and_entry_points(tmp_path, capsys, monkeypatch):
    """A distribution announcing an adapter (its metadata on sys.path, as pip installs it) is listed."""
    info = tmp_path / "r3bridge_toyfw-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: r3bridge-toyfw\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[r3bridge.adapters]\ntoyfw = toyfw\nverl = r3bridge.adapters.verl\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["adapters", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["adapters"]
    names = [(r["name"], r["module"], r["origin"]) for r in rows]
    # the shipped ones first, found in r3bridge's adapters/ folder (by name), then the announced ones
    assert names[:3] == [("areal", "r3bridge.adapters.areal", "r3bridge"), ("skyrl", "r3bridge.adapters.skyrl", "r3bridge"),
                         ("verl", "r3bridge.adapters.verl", "r3bridge")]
    assert ("toyfw", "toyfw", "r3bridge-toyfw") in names
    assert [n for n, _, _ in names].count("verl") == 1          # the shipped one is not listed twice
    assert main(["adapters"]) == 0
    assert "r3bridge-toyfw" in capsys.readouterr().out
