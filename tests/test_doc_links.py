"""Every relative link in README.md, CHANGELOG.md and docs/ names a file or folder of the
repository (anchors are not checked; links inside code are not links), and README.md stays a
short page with the two commands on its first screen."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _broken(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = [link for page in _pages() if page.exists() for link in _broken(page)]
    assert not broken, "links to nothing: " + "; ".join(broken)


def test_the_readme_is_short_and_shows_the_two_commands_on_its_first_screen() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: move detail to docs/ (at most 250)"
    first_screen = lines[:40]
    for command in ("make demo", "make test"):
        assert any(line.startswith(command) for line in first_screen), f"`{command}` not in README.md's first 40 lines"
