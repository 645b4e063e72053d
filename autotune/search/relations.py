"""The search space's relations: `A OP B [if [not] NAME [OP VALUE]]` between engine arguments.

A tiny grammar, parsed, never evaluated as Python; `BUILTIN_RELATIONS` hold in every space
(vLLM refuses a config that breaks them). An operand is a name, a number, or a product of
them (`tensor_parallel_size * data_parallel_size <= host_gpus`: the GPUs one engine holds,
autotune.search.topology); a product with a factor of unknown value is unknown. Its own module because the grammar needs nothing of the space's
parameters: `space.py` reads relations from the `--space` file and checks them here.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Scalar = bool | int | float | str
# A product of factors (names or numbers): `a * b` is ("a", "b").
Operand = Scalar | tuple[Scalar, ...]
Op = Literal[">=", "<=", ">", "<", "==", "!="]

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}


class RelationSpec(BaseModel):
    """A relation in structured form: `left op right`, only checked `when` the condition holds
    (an operand written "a * b" is a product)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    left: Scalar
    op: Op
    right: Scalar
    when: str | None = None


@dataclasses.dataclass(frozen=True)
class Condition:
    """`NAME`, `not NAME` or `NAME OP VALUE`: when a relation applies."""

    name: str
    negate: bool = False
    op: str | None = None
    value: Scalar | None = None

    def holds(self, values: Mapping[str, Any]) -> bool | None:
        """None when the condition's parameter has no known value."""
        if values.get(self.name) is None:
            return None
        current = values[self.name]
        result = bool(current) if self.op is None else _OPS[self.op](current, self.value)
        return not result if self.negate else result


@dataclasses.dataclass(frozen=True)
class Relation:
    """`left op right [if when]`; operands are names (looked up) or constants."""

    text: str
    left: Operand
    op: str
    right: Operand
    when: Condition | None = None

    def names(self) -> set[str]:
        found = {x for operand in (self.left, self.right) for x in _factors(operand) if isinstance(x, str)}
        if self.when is not None:
            found.add(self.when.name)
        return found

    def check(self, values: Mapping[str, Any]) -> bool | None:
        """True (holds), False (broken) or None (a value it needs is unknown: vLLM decides)."""
        if self.when is not None:
            applies = self.when.holds(values)
            if applies is None:
                return None
            if not applies:
                return True
        left = _operand_value(self.left, values)
        right = _operand_value(self.right, values)
        if left is None or right is None:
            return None
        return bool(_OPS[self.op](left, right))


def _factors(operand: Operand) -> tuple[Scalar, ...]:
    return operand if isinstance(operand, tuple) else (operand,)


def _operand_value(operand: Operand, values: Mapping[str, Any]) -> Any:
    """A name's value, a constant, or a product's value (None when a factor is unknown or
    not a number)."""
    if not isinstance(operand, tuple):
        return values.get(operand) if isinstance(operand, str) else operand
    product: Any = 1
    for factor in operand:
        value = values.get(factor) if isinstance(factor, str) else factor
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        product *= value
    return product


_TOKEN = re.compile(r"\s*(>=|<=|==|!=|>|<|\*|[A-Za-z_][A-Za-z0-9_]*|-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?)")


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    text = text.strip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"cannot read {text[position:]!r}")
        tokens.append(match.group(1))
        position = match.end()
    return tokens


def _constant_or_name(token: str) -> Scalar:
    if token in _OPS or token == "*":
        raise ValueError(f"expected a name or a number, got {token!r}")
    lowered = token.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        number = float(token)
    except ValueError:
        return token
    return int(number) if number.is_integer() and "." not in token and "e" not in lowered else number


def parse_condition(text: str) -> Condition:
    tokens = _tokens(text)
    negate = bool(tokens) and tokens[0] == "not"
    if negate:
        tokens = tokens[1:]
    if len(tokens) == 1 and not isinstance(_constant_or_name(tokens[0]), bool | int | float):
        return Condition(name=tokens[0], negate=negate)
    if len(tokens) == 3 and tokens[1] in _OPS:
        name = _constant_or_name(tokens[0])
        if not isinstance(name, str):
            raise ValueError(f"a condition starts with a parameter name, got {tokens[0]!r}")
        return Condition(name=name, negate=negate, op=tokens[1], value=_constant_or_name(tokens[2]))
    raise ValueError(f"condition {text!r}: expected NAME, not NAME or NAME OP VALUE")


def _operand(tokens: list[str]) -> Operand:
    """`NAME`, `NUMBER` or `A * B [* C ...]` (a product) from its tokens."""
    factors = tokens[0::2]
    if not tokens or any(token != "*" for token in tokens[1::2]) or len(tokens) % 2 == 0:
        raise ValueError(f"expected a name, a number or A * B, got {' '.join(tokens)!r}")
    parsed = tuple(_constant_or_name(token) for token in factors)
    return parsed[0] if len(parsed) == 1 else parsed


def _written_operand(value: Scalar) -> Operand:
    """A RelationSpec operand: a string with `*` in it is a product."""
    return _operand(_tokens(value)) if isinstance(value, str) and "*" in value else value


def parse_relation(spec: str | RelationSpec) -> Relation:
    """`"a >= b"`, `"a >= 2048 if not enable_chunked_prefill"`, `"a * b <= host_gpus"` or a
    RelationSpec -> Relation; ValueError (one line) for anything else."""
    if isinstance(spec, RelationSpec):
        when = parse_condition(spec.when) if spec.when else None
        text = f"{spec.left} {spec.op} {spec.right}" + (f" if {spec.when}" if spec.when else "")
        return Relation(text=text, left=_written_operand(spec.left), op=spec.op,
                        right=_written_operand(spec.right), when=when)
    text = spec.strip()
    main, _, condition = text.partition(" if ")
    tokens = _tokens(main)
    ops = [index for index, token in enumerate(tokens) if token in _OPS]
    if len(ops) != 1 or ops[0] in (0, len(tokens) - 1):
        raise ValueError(f"expected 'A OP B [if CONDITION]' with OP one of {' '.join(_OPS)} "
                         "(A and B a name, a number or a product A * B)")
    at = ops[0]
    left, right = _operand(tokens[:at]), _operand(tokens[at + 1:])
    when = parse_condition(condition) if condition.strip() else None
    return Relation(text=text, left=left, op=tokens[at], right=right, when=when)


BUILTIN_RELATIONS: tuple[str, ...] = (
    # vLLM refuses a step budget smaller than the number of sequences it may schedule.
    "max_num_batched_tokens >= max_num_seqs",
    # Without chunked prefill a whole prompt must fit in one step.
    "max_num_batched_tokens >= max_model_len if not enable_chunked_prefill",
)
