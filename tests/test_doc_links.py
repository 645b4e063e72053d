"""Every relative link in README.md, CHANGELOG.md and docs/ names a file or folder of the
repository (anchors are not checked; links inside code are not links)."""

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
