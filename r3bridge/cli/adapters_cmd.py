"""``r3bridge adapters [--json]``: the installed adapters (shipped + ``r3bridge.adapters`` entry points)."""
from __future__ import annotations

import argparse
import dataclasses

from r3bridge.cli._common import print_json, table
from r3bridge.plugins import ENTRY_POINT_GROUP, installed_adapters

NAME = "adapters"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME, help="list installed adapters",
        description=f"List the adapters r3bridge ships and those installed packages announce in the "
                    f"{ENTRY_POINT_GROUP!r} entry-point group (nothing is imported).")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def run(args) -> int:
    entries = installed_adapters()
    if args.json:
        print_json({"adapters": [dataclasses.asdict(e) for e in entries]})
        return 0
    print(table(["adapter", "module", "from"], [[e.name, e.module, e.origin] for e in entries]))
    return 0
