"""``python -m r3bridge.cli``."""
from r3bridge.cli.main import main

raise SystemExit(main())
