"""Shared helpers of the subcommands: loading saved batches, output, plots, optional packages."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import ReplayError


class CliError(Exception):
    """A user-facing problem: ``main`` prints ``error: <message>`` on one line and exits 2."""


def installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (megatron.core takes seconds to import;
    the command imports it for real once the check passed). ``sys.modules[name] = None`` and a
    missing parent package both count as not installed."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(what: str, extra: str, packages: dict[str, str]) -> None:
    """Raise a one-line CliError (exit 2) naming every missing distribution of ``packages``
    ({import name: distribution name}) and the extra that installs them. Commands call it before
    any work starts (the demo: before a rank is spawned), so a missing optional dependency never
    ends in a traceback."""
    missing = [dist for module, dist in packages.items() if not installed(module)]
    if missing:
        raise CliError(f"{what} needs {' and '.join(missing)}, not installed: "
                       f'pip install "r3bridge[{extra}]" (in a checkout: pip install ".[{extra}]")')


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
    require("--plot", "plot", {"matplotlib": "matplotlib"})
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:   # installed but broken: still one line
        raise CliError(f"--plot needs matplotlib, which does not import ({e}): "
                       f'pip install "r3bridge[plot]"') from None
    return plt


def save_figure(fig, out: str) -> None:
    plt = pyplot()
    try:
        fig.savefig(out, dpi=120, bbox_inches="tight")
    except (OSError, ValueError) as e:
        raise CliError(f"{out}: cannot write plot: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)


def report(args, summary: dict, render: Callable[[dict], str], plot: Callable[[dict, str], None]) -> int:
    """The end of every summarising command: ``--plot`` written, then ``--json`` (the summary, with
    the plot's path) or the rendered text on stdout, and the ``wrote`` note. Returns exit code 0."""
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        if args.plot:
            summary["plot"] = args.plot
        print_json(summary)
    else:
        print(render(summary))
    if args.plot:
        info(args, f"wrote {args.plot}")
    return 0
