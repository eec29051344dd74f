"""Every relative link in the user docs (README.md and docs/**/*.md) points at a file that exists,
and every #anchor into a markdown file names one of its headings (GitHub's slug rule)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The file's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def git_ignores(path: Path) -> bool:
    """A link to an ignored file resolves on the machine that wrote it and nowhere else (CI
    failed on an ignored *.png once). Checked only where the tree is a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    result = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(path)], check=False)
    return result.returncode == 0


def broken_links() -> list[str]:
    broken = []
    for doc in doc_files():
        for number, line in prose_lines(doc):
            for match in LINK.finditer(line):
                target = match.group(1) or match.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                resolved = (doc.parent / path_part).resolve() if path_part else doc
                where = f"{doc.relative_to(ROOT)}:{number}: {target}"
                if not resolved.exists():
                    broken.append(f"{where} (no such file)")
                elif git_ignores(resolved):
                    broken.append(f"{where} (git-ignored: exists here, missing from every checkout)")
                elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                    broken.append(f"{where} (no heading #{anchor})")
    return broken


def test_relative_links_in_the_docs_resolve():
    assert broken_links() == []
