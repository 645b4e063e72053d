"""docs/reference/cli.md is what `--help` prints: a flag or help text changed without
regenerating the file fails here, naming the command that regenerates it."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed(generator: ModuleType) -> str:
    text = generator.TARGET.read_text(encoding="utf-8")
    written_with = re.search(r"\(Python (\d+\.\d+),", text)
    if written_with and written_with.group(1) != generator.PYTHON:
        pytest.skip(f"cli.md was written with Python {written_with.group(1)}; argparse's layout differs here")
    return text


def test_the_cli_reference_is_what_help_prints() -> None:
    generator = _generator()
    if _committed(generator) != generator.render():
        pytest.fail(f"docs/reference/cli.md differs from --help: run `{generator.COMMAND}`", pytrace=False)


def test_a_changed_help_text_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator()
    committed = _committed(generator)
    import autotune.cli

    real = autotune.cli.build_parser

    def with_one_help_changed(*, complete: bool = False) -> argparse.ArgumentParser:
        parser = real(complete=True)
        run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
        next(a for a in run._actions if "--trials" in a.option_strings).help = "a help text nobody wrote"
        return parser

    monkeypatch.setattr(autotune.cli, "build_parser", with_one_help_changed)
    changed = generator.render()
    assert changed != committed
    assert "a help text nobody wrote" in changed
