"""Command-line flags generated from a command's typed options model: one declaration each.

A field of a pydantic model becomes a flag when its annotation carries a `Flag` (with
`typing.Annotated`): the field holds the type and the default, the `Flag` the help text, the
help group and how the flag is spelled. `add_flags` builds the argparse arguments from the
model; `flag_values` reads them back as field values, so nothing else restates a flag's name,
type or default. (vLLM derives its flags from its config dataclasses, GuideLLM and AIPerf
from pydantic models; this is the same idea in its smallest form.)

Types: `bool` is a switch (`store_true`); `int`, `float`, `str`, `Path` and their `| None`
take one value; `list[X]` is repeatable (`append`); a `Literal[...]` gives the choices. A
`Flag.parse` turns the flag's text into the field's value after argparse (e.g. `30m` ->
1800.0), raising the project's one-line errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a model field is offered on the command line.

    `group`: the help section it is listed under; `help`: its text (without the default: that
    is added from the field, unless the text says `(default: ...)` itself); `name`: the flag
    when not `--field-name`; `metavar`, `choices` as argparse's; `parse`: text -> value, run
    after argparse on a given value (errors as the caller's error types); `shown_default`: the
    default as help shows it, where the field's None stands for something.
    """

    group: str
    help: str
    name: str | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None
    required: bool = False
    # The default as help shows it when the field's default (None) stands for something.
    shown_default: str | None = None

    def spelled(self, field: str) -> str:
        return self.name or "--" + field.replace("_", "-")


def flag_of(info: FieldInfo) -> Flag | None:
    """The `Flag` a field's annotation carries, if any."""
    return next((item for item in info.metadata if isinstance(item, Flag)), None)


def flagged_fields(model: type[BaseModel]) -> dict[str, tuple[FieldInfo, Flag]]:
    """The model's fields that are flags, in declaration order."""
    found = {}
    for name, info in model.model_fields.items():
        flag = flag_of(info)
        if flag is not None:
            found[name] = (info, flag)
    return found


def add_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    groups: Sequence[str],
    only: Iterable[str] | None = None,
    default_help: dict[str, str] | None = None,
) -> None:
    """Add `model`'s flags to `parser`, one argument group per name in `groups` (in that
    order; a flag whose group is not listed is refused: a typo would hide it). `only`: just
    these fields; `default_help`: per field, a text replacing the default shown in its help."""
    chosen = flagged_fields(model)
    if only is not None:
        wanted = set(only)
        chosen = {name: spec for name, spec in chosen.items() if name in wanted}
    for name, (_, flag) in chosen.items():
        if flag.group not in groups:
            raise ValueError(f"{model.__name__}.{name}: help group {flag.group!r} not in {list(groups)}")
    sections = {group: parser.add_argument_group(f"{group} options") for group in groups}
    # Group by group (usage lists them so too), a group's required flags first, else as declared.
    ordered = sorted(chosen.items(), key=lambda item: (groups.index(item[1][1].group), not item[1][1].required))
    for name, (info, flag) in ordered:
        sections[flag.group].add_argument(
            flag.spelled(name), dest=name, **_argparse_kwargs(info, flag, (default_help or {}).get(name)))


def flag_values(
    args: argparse.Namespace, model: type[BaseModel], *, only: Iterable[str] | None = None
) -> dict[str, Any]:
    """The field values the user gave as flags (a flag left out is left out: the model's
    default applies), each through its `Flag.parse`."""
    wanted = None if only is None else set(only)
    values: dict[str, Any] = {}
    for name, (info, flag) in flagged_fields(model).items():
        if wanted is not None and name not in wanted:
            continue
        given = getattr(args, name, None)
        if given is None or (given is False and _kind(info.annotation)[0] is bool):
            continue
        if flag.parse is not None:
            given = [flag.parse(v) for v in given] if isinstance(given, list) else flag.parse(given)
        values[name] = given
    return values


def _argparse_kwargs(info: FieldInfo, flag: Flag, default_text: str | None) -> dict[str, Any]:
    base, repeated, choices = _kind(info.annotation)
    kwargs: dict[str, Any] = {"help": _help(info, flag, default_text)}
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if flag.required:
        kwargs["required"] = True
    if base is bool and not repeated:
        kwargs["action"] = "store_true"
        return kwargs
    kwargs["default"] = None  # left out: the model's default (flag_values skips it)
    if repeated:
        kwargs["action"] = "append"
    if flag.choices is not None or choices is not None:
        kwargs["choices"] = list(flag.choices if flag.choices is not None else choices)
    if flag.parse is None and base in (int, float, Path):
        kwargs["type"] = base
    return kwargs


def _help(info: FieldInfo, flag: Flag, default_text: str | None) -> str:
    if "(default:" in flag.help:
        return flag.help
    shown = next((text for text in (default_text, flag.shown_default) if text is not None),
                 None) or (None if info.is_required() else _shown_default(info.default))
    return flag.help if shown is None else f"{flag.help} (default: {shown})"


def _shown_default(default: Any) -> str | None:
    if default is None or default is False or default == []:
        return None
    return f"{default:g}" if isinstance(default, float) else str(default)


def _kind(annotation: Any) -> tuple[Any, bool, tuple[Any, ...] | None]:
    """(base type, repeatable, literal choices) of a field's annotation."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _kind(members[0])
        return str, False, None
    if origin is list:
        base, _, choices = _kind(typing.get_args(annotation)[0])
        return base, True, choices
    if origin is Literal:
        values = typing.get_args(annotation)
        return type(values[0]), False, values
    return annotation, False, None
