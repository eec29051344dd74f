"""`r3bridge inspect` / `r3bridge diff`: output parsed back, plots written, errors exit 2."""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import r3bridge
from r3bridge.cli import main as cli_main
from r3bridge.cli.main import main

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# 2 sequences, layers (1, 3), 4 experts, top-2. Sequence 1 starts at token 2; its last row has
# no route (invalid). Per-row routes [layer 1, layer 3]:
SEQ0 = [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 0], [3, 0]]]
SEQ1 = [[[3, 2], [1, 0]], [[0, 1], [0, 1]]]
VALID = [[True, True, True], [True, False]]


def _batch(seq0=SEQ0, seq1=SEQ1, valid=VALID, route_kind="rollout", engine="vllm"):
    return r3bridge.ReplayBatch.from_ragged([torch.tensor(seq0), torch.tensor(seq1)], num_experts=4,
                                            layer_ids=[1, 3], start_rows=[0, 2], valid=valid,
                                            route_kind=route_kind, engine=engine)


@pytest.fixture
def files(tmp_path):
    a = _batch()
    # b: same sequences; row 0 layer 1 differs as a set ({0,3}); row 2 layer 1 only reordered;
    # row 0 of sequence 1 differs in layer 3 ({1,2}).
    seq0 = [[[0, 3], [2, 3]], [[0, 2], [2, 3]], [[0, 1], [3, 0]]]
    seq1 = [[[3, 2], [1, 2]], [[0, 1], [0, 1]]]
    b = _batch(seq0, seq1, valid=[[True, True, True], [True, True]], route_kind="recorded", engine=None)
    pa, pb = tmp_path / "rollout.r3b", tmp_path / "recorded.r3b"
    pa.write_bytes(a.to_bytes())
    pb.write_bytes(b.to_bytes())
    bad = tmp_path / "truncated.r3b"
    bad.write_bytes(a.to_bytes()[:-5])
    return types.SimpleNamespace(a=str(pa), b=str(pb), bad=str(bad), tmp=tmp_path, batch=a)


def _expected_load():
    """Counts per expert per layer over valid rows, by hand from SEQ0 / SEQ1 / VALID."""
    load = {1: [0] * 4, 3: [0] * 4}
    for seq, val in ((SEQ0, VALID[0]), (SEQ1, VALID[1])):
        for row, ok in zip(seq, val):
            if ok:
                for j, lid in enumerate((1, 3)):
                    for e in row[j]:
                        load[lid][e] += 1
    return load


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_inspect_text(files, capsys):
    assert main(["inspect", files.a]) == 0
    out = capsys.readouterr().out
    assert "rollout.r3b" in out
    assert "samples  2" in out
    assert "tokens   5  (valid 4, coverage 80.00%)" in out
    assert "[5, 2, 2] uint8" in out
    assert "layers   2: 1, 3" in out
    assert "source   vllm" in out
    # table: layer, min, max, imbalance, unused
    rows = {int(l.split()[0]): l.split() for l in out.splitlines()[-2:]}
    load = _expected_load()
    uniform = 4 * 2 / 4
    for lid in (1, 3):
        _, mn, mx, imb, unused = rows[lid]
        assert (int(mn), int(mx), int(unused)) == (min(load[lid]), max(load[lid]), load[lid].count(0))
        assert float(imb) == pytest.approx(max(load[lid]) / uniform, abs=0.005)


def test_inspect_json_and_plot(files, capsys):
    png = files.tmp / "load.png"
    assert main(["inspect", files.a, "--json", "--plot", str(png)]) == 0
    cap = capsys.readouterr()
    s = json.loads(cap.out)                     # exactly one JSON object on stdout
    assert cap.out.strip().count("\n") == 0
    assert "wrote" in cap.err
    assert s["samples"] == 2 and s["tokens"] == 5 and s["valid_tokens"] == 4
    assert s["coverage"] == pytest.approx(4 / 5)
    assert s["shape"] == [5, 2, 2] and s["dtype"] == "uint8"
    assert s["layer_ids"] == [1, 3] and s["num_experts"] == 4 and s["topk"] == 2
    assert s["source"] == "vllm" and s["bytes"] == files.batch.nbytes == os.path.getsize(files.a)
    assert s["start_rows"] == {"min": 0, "max": 2}
    load = _expected_load()
    for entry in s["expert_load"]:
        assert entry["counts"] == load[entry["layer"]]
        assert entry["imbalance"] == pytest.approx(max(load[entry["layer"]]) / 2.0)
    assert _is_png(png)


def test_diff_text_json_and_plot(files, capsys):
    assert main(["diff", files.a, files.b]) == 0
    out = capsys.readouterr().out
    # compared rows: valid in both = 4 (sequence 1's last row is invalid in A)
    # layer 1: rows differ as sets only at seq 0 row 0 -> 3/4; layer 3: seq 1 row 0 -> 3/4
    assert "tokens compared   4  (overlap 5; valid only in A: 0, only in B: 1)" in out
    assert "agreement         75.00%" in out
    assert "50.00% of tokens differ" in out
    png = files.tmp / "agree.png"
    assert main(["diff", files.a, files.b, "--json", "--plot", str(png)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["agreement"] == pytest.approx(6 / 8)
    assert s["tokens_differing_any_layer"] == pytest.approx(2 / 4)
    assert s["tokens_compared"] == 4 and s["tokens_valid_only_b"] == 1
    assert [(r["layer"], r["agree"], r["differing_tokens"]) for r in s["per_layer"]] == [(1, 3, 1), (3, 3, 1)]
    assert (s["source_a"], s["source_b"]) == ("vllm", "recorded")
    assert _is_png(png)
    # identical files agree fully
    assert main(["diff", files.a, files.a, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["agreement"] == 1.0 and s["tokens_differing_any_layer"] == 0.0


def test_bad_files_exit_2_with_one_line(files, capsys):
    assert main(["inspect", files.bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and files.bad in err and err.count("\n") == 1
    missing = str(files.tmp / "missing.r3b")
    assert main(["inspect", missing, "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and missing in cap.err
    assert main(["diff", files.a, files.bad]) == 2
    assert files.bad in capsys.readouterr().err
    garbage = files.tmp / "garbage.r3b"
    garbage.write_bytes(b"R3RB" + os.urandom(200))
    assert main(["inspect", str(garbage)]) == 2
    assert str(garbage) in capsys.readouterr().err
    # two valid files that cannot be compared: both named
    other = files.tmp / "one_seq.r3b"
    other.write_bytes(_batch().select([0]).to_bytes())
    assert main(["diff", files.a, str(other)]) == 2
    err = capsys.readouterr().err
    assert files.a in err and str(other) in err and err.count("\n") == 1


def test_subprocess_inspect_json(files):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "r3bridge.cli.main", "inspect", files.a, "--json"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["tokens"] == 5 and s["layer_ids"] == [1, 3]
    assert p.stderr == ""


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_module_entry_exit_code(files, monkeypatch, capsys):
    # `python -m r3bridge.cli.main` turns main()'s return value into the process exit status
    monkeypatch.setattr(sys, "argv", ["r3bridge", "inspect", files.bad])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("r3bridge.cli.main", run_name="__main__", alter_sys=False)
    assert e.value.code == 2
    # the last line: runpy may print a RuntimeWarning first when warnings are not filtered
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")


def test_inspect_never_imports_demo(files, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli_main, "_load_optional", lambda name: calls.append(name) or (None, "x"))
    assert main(["inspect", files.a, "--json"]) == 0
    assert calls == []
    capsys.readouterr()


def test_demo_hook_registers_module_or_reports_unavailable(monkeypatch, capsys):
    fake = types.ModuleType("r3bridge.cli.demo")

    def add_parser(sub):
        p = sub.add_parser("demo")
        p.add_argument("--steps", type=int, default=1)
        return p

    fake.add_parser = add_parser
    fake.run = lambda args: 0 if args.steps == 3 else 1
    monkeypatch.setitem(sys.modules, "r3bridge.cli.demo", fake)
    assert main(["demo", "--steps", "3"]) == 0
    # a broken demo module: inspect still works, `demo` says why it is unavailable
    monkeypatch.setitem(sys.modules, "r3bridge.cli.demo", None)   # import raises ImportError
    assert main(["demo", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "unavailable" in err
