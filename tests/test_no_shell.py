"""No shell strings and no unsafe YAML loads anywhere in the project's Python.

Two layers: ruff's bandit rules in pyproject.toml (S602/S604-S607 shell, S506 yaml.load), run by
`make test`; and this AST check, which also catches what those rules miss
(`asyncio.create_subprocess_shell`, `yaml.full_load` / `unsafe_load`, `["sh", "-c", ...]`).
Both are shown to fire on a sample, so a config change that silences them fails here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autotune", "server", "workloads", "tests", "benchmarks", "scripts")
RUFF_RULES = {"S506", "S602", "S604", "S605", "S606", "S607"}
SHELL_CALLS = {
    "os.system",
    "os.popen",
    "subprocess.getoutput",
    "subprocess.getstatusoutput",
    "asyncio.create_subprocess_shell",
}
SHELL_METHODS = {"create_subprocess_shell", "subprocess_shell"}  # asyncio, any receiver
SHELLS = {"sh", "bash", "zsh", "dash", "/bin/sh", "/bin/bash", "/usr/bin/env"}
UNSAFE_YAML = {
    "yaml.load",
    "yaml.load_all",
    "yaml.full_load",
    "yaml.full_load_all",
    "yaml.unsafe_load",
    "yaml.unsafe_load_all",
}
SAFE_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "SafeLoader", "CSafeLoader"}

SAMPLE = '''
import asyncio, os, subprocess, yaml
subprocess.run("ls -l", shell=True)
subprocess.Popen(["ls"], shell=1)
os.system("ls")
asyncio.create_subprocess_shell("ls")
subprocess.run(["bash", "-c", "ls | wc"])
yaml.load(text)
yaml.full_load(text)
yaml.unsafe_load(text)
yaml.compose(text, Loader=yaml.Loader)
'''


def dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def violations(source: str, filename: str) -> list[str]:
    """`file:line: what` for each shell string or unsafe YAML load in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        where = f"{filename}:{node.lineno}"
        for keyword in node.keywords:
            if keyword.arg == "shell" and not (
                isinstance(keyword.value, ast.Constant) and keyword.value.value in (False, None)
            ):
                found.append(f"{where}: {name}(shell=...)")
            if keyword.arg == "Loader" and name.startswith("yaml.") and dotted(keyword.value) not in SAFE_LOADERS:
                found.append(f"{where}: {name}(Loader={dotted(keyword.value)})")
        if name in SHELL_CALLS or name.rsplit(".", 1)[-1] in SHELL_METHODS:
            found.append(f"{where}: {name}()")
        if name in UNSAFE_YAML:
            found.append(f"{where}: {name}() (use yaml.safe_load)")
        for argument in node.args[:1]:
            if isinstance(argument, ast.List | ast.Tuple) and argument.elts:
                first = argument.elts[0]
                flags = {e.value for e in argument.elts if isinstance(e, ast.Constant)}
                if isinstance(first, ast.Constant) and first.value in SHELLS and "-c" in flags:
                    found.append(f"{where}: {first.value} -c (a shell string)")
    return found


def project_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_the_check_fires_on_every_kind_of_shell_string_and_unsafe_load() -> None:
    found = violations(SAMPLE, "sample.py")
    assert [line.split(":")[1] for line in found] == [str(n) for n in range(3, 12)], found


def test_no_shell_strings_or_unsafe_yaml_in_the_project(reliability) -> None:
    reliability.start(
        "No shell strings, YAML through safe_load only",
        group="Security defaults",
        injected=(
            "an AST scan of every Python file (autotune, server, workloads, tests, benchmarks, "
            "scripts) and ruff's S506/S602/S604-S607 rules from pyproject.toml"
        ),
    )
    files = project_files()
    found = [line for path in files for line in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []
    reliability.held(
        "no shell=True, os.system/popen, create_subprocess_shell, `sh -c` argv, yaml.load/"
        "full_load/unsafe_load or non-safe Loader anywhere"
    )
    reliability.figure("Python files scanned", len(files))


def test_ruff_enforces_the_same_rules(tmp_path: Path) -> None:
    selected = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["select"])
    assert RUFF_RULES <= selected, RUFF_RULES - selected
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE.replace("(text", "(open('f').read()"))
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
         "--output-format", "concise", str(sample)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert {"S602", "S605", "S506"} <= {word for word in done.stdout.split() if word[:1] == "S" and word[1:].isdigit()}
