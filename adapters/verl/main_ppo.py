"""``python -m r3bridge.adapters.verl.main_ppo`` = verl's ``main_ppo`` plus the ``r3bridge`` section.

Takes exactly verl's hydra overrides, plus ``r3bridge.replay_mode=R2|R3|off`` and the core's
options (``r3bridge.agreement``, ``r3bridge.min_coverage``, ...). They are passed to hydra as
``++r3bridge.*`` (add-or-override), which works whether or not the composed config already has an
``r3bridge`` section (``+`` fails when it has one, a bare key fails when it has none). Validates the
whole job config before Ray starts (``r3bridge.ConfigError`` listing every problem), logs the replay
mode in force and where it came from, forwards the section to every worker, then runs verl's own
``main``.
"""
from __future__ import annotations

import os
import sys

__all__ = ["main", "rewrite_overrides"]

_SECTION = ("r3bridge.", "r3bridge=")


def rewrite_overrides(argv: list[str]) -> list[str]:
    """``r3bridge.x=y`` / ``+r3bridge.x=y`` -> ``++r3bridge.x=y``; everything else unchanged."""
    out = []
    for a in argv:
        bare = a.lstrip("+")
        out.append(f"++{bare}" if bare.startswith(_SECTION) and len(a) - len(bare) <= 2 else a)
    return out


def main() -> None:
    import hydra
    import verl.trainer.main_ppo as verl_main

    from r3bridge.adapters.verl.config import prepare_verl_config
    from r3bridge.versions import check_internals, check_release

    check_release("verl", what="'s verl launcher")
    # verl's main body, without its own @hydra.main wrapper (this launcher composes the config)
    check_internals("verl", [("verl.trainer.main_ppo.main.__wrapped__", verl_main.main, "__wrapped__")])
    config_dir = os.path.join(os.path.dirname(verl_main.__file__), "config")

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def _main(config) -> None:
        prepare_verl_config(config, announce_where="verl launcher")
        verl_main.main.__wrapped__(config)     # verl's main body, on the already-composed config

    sys.argv = [sys.argv[0], *rewrite_overrides(sys.argv[1:])]
    _main()


if __name__ == "__main__":
    main()
