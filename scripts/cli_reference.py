"""Write docs/reference/cli.md from the `--help` of `autotune` and of each of its subcommands.

    .venv/bin/python scripts/cli_reference.py           # rewrite docs/reference/cli.md
    .venv/bin/python scripts/cli_reference.py --check   # exit 1 when the committed file differs

The help comes from the real parsers (`autotune.cli.build_parser`, every command's flags
added), formatted at a fixed width so the file is the same on every terminal; no command runs
and no engine starts.
tests/test_cli_reference.py fails when the committed file is not what this writes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "reference" / "cli.md"
COMMAND = ".venv/bin/python scripts/cli_reference.py"
WIDTH = 100  # columns argparse wraps help to (it reads $COLUMNS when it formats)

# argparse's layout changes between Python versions (3.13 reworded usage lines), so the file
# names the version it was written with and the test compares only under that version.
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
HEADER = f"""# CLI reference

Generated from `--help` by `{COMMAND}` (Python {PYTHON}, {WIDTH} columns); do not edit by
hand: a test fails when this file and `--help` differ. The flags a user reaches for first, with
a word on each: [run flags](run-flags.md). Exit codes: [exit codes](exit-codes.md).
"""


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _walk(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for sub_name, sub in _subcommands(parser):
        yield from _walk(sub, f"{name} {sub_name}")


def render() -> str:
    """The whole of docs/reference/cli.md, as the parsers' help prints it at WIDTH columns."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from autotune.cli import build_parser

    saved = {key: os.environ.get(key) for key in ("COLUMNS", "NO_COLOR")}
    os.environ["COLUMNS"] = str(WIDTH)
    os.environ["NO_COLOR"] = "1"
    try:
        commands = list(_walk(build_parser(complete=True), "autotune"))
        sections = [HEADER]
        sections.append("\n".join(f"- [`{name}`](#{_anchor(name)})" for name, _ in commands) + "\n")
        for name, parser in commands:
            sections.append(f"## {name}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return "\n".join(sections)


def _anchor(heading: str) -> str:
    return heading.lower().replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET.relative_to(ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    temporary = TARGET.with_suffix(".md.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(TARGET)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
