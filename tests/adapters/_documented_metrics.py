"""The metric keys docs/metrics.md section 0 documents, as patterns a real run's keys must match.

The real-framework tests (verl, SkyRL, AReaL) pass what the framework actually logged to
:func:`check_logged`: every r3bridge key logged must be a documented one, and the keys every job
logs must be there, so the docs and the frameworks cannot drift apart.
"""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_patterns() -> list[re.Pattern]:
    """One regex per key of section 0's first table (``<tag>`` -> a phase, ``<id>`` -> a layer id,
    ``{a,b}`` -> alternatives, ``.../x`` -> the row's first key with its last part replaced)."""
    text = DOC.read_text()
    section = text[text.index("## 0."):text.index("## 1.")]
    table = section[section.index("| key | what |"):section.index("\n\n", section.index("| key | what |"))]
    out: list[re.Pattern] = []
    for row in table.splitlines()[2:]:
        keys = re.findall(r"`([^`]+)`", row.split("|")[1])
        first = None
        for key in keys:
            if key.startswith(".../"):
                key = first.rsplit("/", 1)[0] + key[3:]
            first = first or key
            rx = re.escape(key).replace(re.escape("<tag>"), "(old_log_prob|update)").replace(re.escape("<id>"), r"\d+")
            rx = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(" + m.group(1).replace(",", "|").replace("\\", "") + ")", rx)
            out.append(re.compile(rx + "$"))
    return out


ALWAYS = ("r3bridge/replay_mode", "r3bridge/update/agreement/mean", "r3bridge/update/agreement/layer_min",
          "r3bridge/update/coverage", "r3bridge/update/replayed_pairs", "r3bridge/update/native_pairs",
          "r3bridge/update/agreement/pairs_compared")


def check_logged(keys, *, framework_prefix: str = "", framework_suffixes: tuple[str, ...] = ()) -> None:
    """``keys`` as the framework logged them (with its own ``framework_prefix``, e.g. SkyRL's
    ``policy/``; ``framework_suffixes`` it adds beside each, e.g. AReaL's ``__count``)."""
    patterns = documented_patterns()
    ours = []
    for k in keys:
        if not k.startswith(framework_prefix + "r3bridge/"):
            assert "r3bridge/" not in k, f"{k!r}: an r3bridge key under a framework scope (phase repeated?)"
            continue
        k = k[len(framework_prefix):]
        for suffix in framework_suffixes:
            k = k[:-len(suffix)] if k.endswith(suffix) else k
        ours.append(k)
        assert any(p.match(k) for p in patterns), f"{k!r} is logged but not documented in docs/metrics.md section 0"
    missing = [k for k in ALWAYS if k not in ours]
    assert not missing, f"documented keys missing from the run: {missing}; logged: {sorted(ours)}"
    layers = [k for k in ours if re.match(r"r3bridge/update/agreement/layer_\d+$", k)]
    assert 1 <= len(layers) <= 3, layers      # the compact default: the worst layers only
