"""``python -m r3bridge.adapters.verl.main_ppo`` = verl's ``main_ppo`` plus the ``r3bridge`` section.

Takes exactly verl's hydra overrides, plus ``r3bridge.replay_mode=R2|R3|off`` and the core's
options (``r3bridge.agreement``, ``r3bridge.min_coverage``, ...; the ``+`` hydra needs for a new
key is added for you). Validates the whole job config before Ray starts (``r3bridge.ConfigError``
listing every problem), forwards the section to every worker, then runs verl's own ``main``.
"""
from __future__ import annotations

import os
import sys

__all__ = ["main", "rewrite_overrides"]


def rewrite_overrides(argv: list[str]) -> list[str]:
    """``r3bridge.x=y`` -> ``+r3bridge.x=y`` (the key is not in verl's schema)."""
    return [f"+{a}" if a.startswith("r3bridge.") or a.startswith("r3bridge=") else a for a in argv]


def main() -> None:
    import hydra
    import verl.trainer.main_ppo as verl_main

    from r3bridge.adapters.verl.config import prepare_verl_config

    config_dir = os.path.join(os.path.dirname(verl_main.__file__), "config")

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def _main(config) -> None:
        prepare_verl_config(config)
        verl_main.main.__wrapped__(config)     # verl's main body, on the already-composed config

    sys.argv = [sys.argv[0], *rewrite_overrides(sys.argv[1:])]
    _main()


if __name__ == "__main__":
    main()
