"""`autotune run`'s options are declared once: each a TuningRequest field, its flag generated."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel

from autotune.cli import build_parser
from autotune.cli.run import run_request
from autotune.options import Flag, add_flags, flag_values, flagged_fields
from autotune.request import (
    MEASUREMENT_FIELDS,
    RUN_GROUPS,
    MeasurementOptions,
    RetuneRequest,
    TuningRequest,
)

CLI = Path(__file__).resolve().parents[3] / "autotune" / "cli"
HAND_DECLARED = re.compile(r"""\badd(?:_argument)?\(\s*["'](--[a-z0-9-]+)["']""")


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(complete=True)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.option_strings[-1]: action for action in parser._actions
            if action.option_strings and action.dest != "help"}


def test_each_run_option_is_one_request_field_and_nothing_declares_it_by_hand() -> None:
    fields = flagged_fields(TuningRequest)
    declared = {flag.spelled(name): name for name, (_, flag) in fields.items()}
    options = _options(_subparser("run"))
    # One to one: every flag of `autotune run` is a field, every flagged field a flag.
    assert set(options) == set(declared)
    assert all(options[flag].dest == name for flag, name in declared.items())
    # No module of the command line spells one of them out: run.py and retune.py declare none.
    by_module = {path.name: set(HAND_DECLARED.findall(path.read_text(encoding="utf-8")))
                 for path in CLI.glob("*.py")}
    assert by_module["run.py"] == set() and by_module["retune.py"] == set()


def test_retune_takes_runs_measurement_options_from_the_same_declarations() -> None:
    retune = {flag.spelled(name): name for name, (_, flag) in flagged_fields(RetuneRequest).items()}
    assert set(_options(_subparser("retune"))) == set(retune)
    # The measurement options are declared once, on MeasurementOptions, for both commands.
    for name in MEASUREMENT_FIELDS:
        assert RetuneRequest.model_fields[name] is MeasurementOptions.model_fields[name] or \
            RetuneRequest.model_fields[name].metadata == MeasurementOptions.model_fields[name].metadata
        assert TuningRequest.model_fields[name].metadata == MeasurementOptions.model_fields[name].metadata


def test_the_help_shows_each_fields_default_and_groups_them_as_the_request_does() -> None:
    parser = _subparser("run")
    titles = [group.title for group in parser._action_groups if group._group_actions]
    assert titles[1:] == [f"{group} options" for group in RUN_GROUPS]  # after argparse's (-h)
    text = parser.format_help()
    assert "(default: 0.1)" in re.sub(r"\s+", " ", text.split("--ladder-resolution R", 2)[2])[:300]
    for name, (info, flag) in flagged_fields(TuningRequest).items():
        option = _options(parser)[flag.spelled(name)]
        if not info.is_required() and info.default not in (None, False, []) and "(default:" not in flag.help:
            shown = f"{info.default:g}" if isinstance(info.default, float) else str(info.default)
            assert option.help.endswith(f"(default: {shown})"), name


def test_a_flag_left_out_takes_the_fields_default_and_a_given_one_its_parse() -> None:
    args = build_parser().parse_args(["run", "--workload", "w.jsonl"])
    default = run_request(args)
    # (The two fields the environment may also set are left out: the test session sets both.)
    environment = {"max_client_lag_ms", "fork_server_socket", "command_line"}
    assert default.model_dump(exclude=environment) == \
        TuningRequest(workload="w.jsonl").model_dump(exclude=environment)
    args = build_parser().parse_args(["run", "--workload", "w.jsonl", "--time-budget", "30m",
                                      "--allow", "fp8", "--allow", "fp8", "--top-k", "2"])
    request = run_request(args)
    assert (request.time_budget_s, request.allow, request.top_k) == (1800.0, ["fp8"], 2)
    assert request.trials is None  # a time budget and no --trials: the budget decides


def test_adding_an_option_is_adding_one_field() -> None:
    class Options(BaseModel):
        depth: Annotated[int, Flag("search", "how deep", metavar="N")] = 3
        name: Annotated[str | None, Flag("output", "what to call it")] = None

    parser = argparse.ArgumentParser()
    add_flags(parser, Options, groups=("search", "output"))
    assert "--depth N" in parser.format_help() and "(default: 3)" in parser.format_help()
    assert Options(**flag_values(parser.parse_args(["--depth", "5"]), Options)) == Options(depth=5)
    assert Options(**flag_values(parser.parse_args([]), Options)) == Options()


def test_nothing_below_the_command_line_reads_flags_or_returns_an_exit_code() -> None:
    # Below autotune/cli/, code takes typed values and returns typed outcomes (RunOutcome, a
    # published flag); only the command line turns them into exit codes. autotune/options.py
    # is the flag machinery itself; the fork server's process entry parses its own two flags.
    package = CLI.parent
    exempt = {package / "options.py", package / "errors.py", package / "measure" / "forkserver_process.py"}
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if CLI in path.parents or path in exempt:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None and \
                    "Namespace" in ast.unparse(node.annotation):
                offenders.append(f"{path.relative_to(package.parent)}: parameter {node.arg}")
            if isinstance(node, ast.ImportFrom) and node.module == "autotune.errors" and \
                    any(alias.name.startswith("EXIT_") for alias in node.names):
                offenders.append(f"{path.relative_to(package.parent)}: imports an exit code")
    assert not offenders, offenders
