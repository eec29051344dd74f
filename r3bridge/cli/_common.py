"""Shared helpers of the subcommands: loading saved batches, output, plots."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from r3bridge.errors import ReplayError
from r3bridge.schema import ReplayBatch


class CliError(Exception):
    """A user-facing problem: ``main`` prints ``error: <message>`` on one line and exits 2."""


def load_batch(path: str) -> tuple[ReplayBatch, int]:
    """Read a file written from ``ReplayBatch.to_bytes()`` -> (batch, file size in bytes)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CliError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return ReplayBatch.from_bytes(data), len(data)
    except ReplayError as e:
        raise CliError(f"{path}: not a valid r3bridge route file: {e}") from None
    except Exception as e:  # noqa: BLE001 - any decoding failure of user input is a bad file
        raise CliError(f"{path}: not a valid r3bridge route file: {type(e).__name__}: {e}") from None


def save_batch(batch: ReplayBatch, path: str) -> int:
    """Write ``batch.to_bytes()`` to ``path`` (suggested extension ``.r3b``). Returns bytes written."""
    data = batch.to_bytes()
    Path(path).write_bytes(data)
    return len(data)


def jsonable(x: Any) -> Any:
    """NaN / inf -> None (strict JSON), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def print_json(obj: dict) -> None:
    """Exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(jsonable(obj), allow_nan=False) + "\n")


def info(args, msg: str) -> None:
    """Progress / side notes: stdout in text mode, stderr under --json (stdout holds the JSON)."""
    print(msg, file=sys.stderr if getattr(args, "json", False) else sys.stdout)


def fmt_ids(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    ids = list(ids)
    if not ids:
        return "-"
    runs, start, prev = [], ids[0], ids[0]
    for x in ids[1:]:
        if x == prev + 1:
            prev = x
            continue
        runs.append((start, prev))
        start = prev = x
    runs.append((start, prev))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def fmt_pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100.0 * x:.2f}%"


def fmt_num(x: float, nd: int = 2) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.{nd}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    """Right-aligned plain-text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(indent + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def pyplot():
    """matplotlib.pyplot on the Agg backend (headless); CliError if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("--plot needs matplotlib (pip install 'r3bridge[plot]')") from None
    return plt


def save_figure(fig, out: str) -> None:
    plt = pyplot()
    try:
        fig.savefig(out, dpi=120, bbox_inches="tight")
    except (OSError, ValueError) as e:
        raise CliError(f"{out}: cannot write plot: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)
