"""The value types and range checks of job keys, and how a key is declared: ``_key(default, type,
doc, choices=..., check=..., applies=...)`` makes a dataclass field whose metadata the schema
table, the loader and ``describe`` read. A type converts a TOML value or raises TypeError; a
check returns None or what is wrong ("must be >= 1"). ``toml_value`` writes a value as TOML.

The schema itself (the sections and their keys) is ``config``'s.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..parallel.pipeline.partition import PARTITION_METHODS


# --- value types: each converts a TOML value or raises TypeError -------------------------------------

@dataclass(frozen=True)
class Type:
    name: str  # for messages: "expected an integer"
    convert: Callable[[Any], Any]


def _integer(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError
    return v


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError
    try:
        value = float(v)
    except OverflowError:  # an integer beyond any float
        raise TypeError from None
    if not math.isfinite(value):  # TOML's inf and nan: no key means anything by them (lr = inf trained on NaNs)
        raise TypeError
    return value


def _boolean(v):
    if not isinstance(v, bool):
        raise TypeError
    return v


def _string(v):
    if not isinstance(v, str):
        raise TypeError
    return v


def _list_of(convert, length=None):
    def check(v):
        if not isinstance(v, list) or not v or (length is not None and len(v) != length):
            raise TypeError
        return tuple(convert(x) for x in v)
    return check


def _strings(v):
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise TypeError
    return tuple(v)


def _partition(v):
    return v if isinstance(v, str) else _list_of(_integer)(v)


INTEGER = Type("an integer", _integer)
NUMBER = Type("a finite number", _number)
BOOLEAN = Type("true or false", _boolean)
STRING = Type("a string", _string)
NUMBER_PAIR = Type("a list of 2 finite numbers", _list_of(_number, 2))
INTEGER_PAIR = Type("a list of 2 integers", _list_of(_integer, 2))
def _resume(v):
    if isinstance(v, bool):  # true/false are refused: the policy is a name or a step folder
        raise TypeError
    return _string(v)


def _zero_stage(v):
    if isinstance(v, bool):  # the old key: true was ZeRO-1 (load_job says so once)
        return int(v)
    return _integer(v)


ZERO_STAGE = Type("a ZeRO stage 0, 1, 2 or 3 (an integer; the old true is 1, false 0)", _zero_stage)
PARTITION = Type("a method name or a list of per-stage layer counts", _partition)
STRING_LIST = Type("a list of non-empty strings (may be empty)", _strings)
RESUME = Type("auto, never, must or a step folder (a string; the old true is \"auto\", false \"never\")", _resume)
RESUME_MODES = ("auto", "never", "must")  # anything else is a step folder


# --- range checks: each is called with a converted value and returns None or what is wrong ----------

@dataclass(frozen=True)
class Check:
    text: str  # "must be ..." and the schema table's allowed column
    test: Callable[[Any], bool]

    def __call__(self, value) -> str | None:
        return None if self.test(value) else f"must be {self.text}"


def at_least(low) -> Check:
    return Check(f">= {low}", lambda v: v >= low)


def above(low) -> Check:
    return Check(f"> {low}", lambda v: v > low)


def in_range(low, high) -> Check:
    return Check(f"in [{low}, {high})", lambda v: low <= v < high)


def each(check: Check) -> Check:
    return Check(f"each {check.text}", lambda values: all(check.test(v) for v in values))


STAGE_COUNTS = Check(f"one of {', '.join(PARTITION_METHODS)} or per-stage counts each >= 1",
                     lambda v: v in PARTITION_METHODS if isinstance(v, str) else all(c >= 1 for c in v))


class Positive:
    """The values of an ``applies`` rule ``(key, POSITIVE)``: that key above 0 (``[model.moe]`` keys
    act only with experts > 0)."""

    def __contains__(self, value) -> bool:
        return value is not None and value > 0


POSITIVE = Positive()


def applies_text(selector: str, allowed) -> str:
    """``selector = a or b`` (``selector > 0``): when a key with this ``applies`` rule has an effect."""
    if allowed is POSITIVE:
        return f"{selector} > 0"
    return f"{selector} = {' or '.join(map(toml_value, allowed))}"


def _key(default, type_: Type, doc: str, *, choices=None, check=None, applies=None, name=None, hint=None):
    """One key of a section. ``applies = (other key, values)``: it has an effect only then.
    ``name``: the TOML key where it is not a Python name (``async``); ``hint``: {bad value: advice}."""
    return field(default=default, metadata={"type": type_, "doc": doc, "choices": choices, "check": check,
                                            "applies": applies, "name": name, "hint": hint or {}})


def toml_key(f) -> str:
    return f.metadata["name"] or f.name


def toml_value(value) -> str:
    """A value as TOML text (strings through JSON, whose escapes TOML's basic strings share)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)
