"""``python -m r3bridge ...``: the ``r3bridge`` command line."""
from r3bridge.cli.main import main

raise SystemExit(main())
