"""The ``r3bridge`` command line: ``inspect`` and ``diff`` saved route sets, ``demo``.

Entry point: :func:`r3bridge.cli.main.main` (``[project.scripts] r3bridge``; also
``python -m r3bridge.cli.main`` or ``python -m r3bridge.cli``). Each subcommand module exposes
``add_parser(subparsers)`` and ``run(args) -> int``.
"""
