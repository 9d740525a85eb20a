"""Reading a job: the TOML file and ``--set`` overrides, each key checked on its own (the schema:
config.py; validation of the keys together: validate.py).

    job = validate(load_job("jobs/demo.toml", ["parallel.tp=2", "train.steps=50"]), world_size)
    if rank == 0:
        print(job.describe())

Checking happens in two steps, both pure functions of the file, the overrides and the world
size, so every rank reaches the same verdict before any rank waits on another: ``load_job``, each
key on its own, and ``validate``, what needs the keys together and the world size (the dp x pp x
tp layout, heads and vocabulary divisible by tp, batch divisible by dp and micro-batches, pipeline
stages versus layers, modes that exclude each other, the data file). Every problem is reported
in one ``JobError`` (a ValueError) naming the file, the key (``parallel.tp``), the numbers and the
fix; all problems of a step are listed at once.
"""
from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import replace
from typing import Any

from ..paths import input_problem
from .config import (DEPRECATED_SECTIONS, NESTED_SECTIONS, PATH_KEYS, SECTIONS, Job, JobError, _fields_by_key,
                     section_title)
from .config_types import applies_text, toml_value



def _suggest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value in TOML syntax, a bare word as a string."""
    name, sep, raw = text.partition("=")
    parts = name.strip().split(".")
    if len(parts) == 3 and NESTED_SECTIONS.get(parts[1]) == parts[0]:  # model.moe.experts: section moe
        parts = parts[1:]
    if not sep or len(parts) != 2 or not all(parts):
        raise JobError("--set", [(text, "expected section.key=value, e.g. --set parallel.tp=2 or "
                                        "--set checkpoint.dir=\"runs/x\"")])
    raw = raw.strip()
    try:
        doc = tomllib.loads(f"value = {raw}")
        value = doc["value"] if len(doc) == 1 else raw
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: parallel.schedule=gpipe
    return parts[0], parts[1], value


def _read_toml(path: str) -> dict:
    problem = input_problem(path)  # a folder fails late; a named pipe would block the read forever
    if problem == "does not exist":
        raise JobError(path, [("", f"no such job file (looked in {os.path.abspath(path)})")])
    if problem:
        raise JobError(path, [("", f"the job file {problem}; give a TOML file such as jobs/demo.toml")])
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        text = f"invalid TOML: {err}"
        line = re.search(r"at line (\d+)", str(err))
        if line:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
            number = int(line.group(1))
            if 1 <= number <= len(lines):
                text += f"\n    line {number}: {lines[number - 1].strip()}"
        raise JobError(path, [("", text)]) from None


def load_job(path: str | None, overrides: list[str] = ()) -> Job:
    """Read a job file (None: all defaults), apply ``section.key=value`` overrides, check each key.

    The checks: TOML syntax (with the line), unknown sections and keys (with "did you mean" and
    the allowed names), types, ranges and choices, and keys given a non-default value where they
    have no effect (``parallel.staleness`` without ``mode = "ps"``).
    """
    raw = _read_toml(path) if path is not None else {}
    source = path if path is not None else "<defaults>"
    notices, problems = _rename_deprecated_sections(raw, source)
    problems += _hoist_nested_sections(raw)
    from_cli = set()
    for text in overrides:
        section, key, value = parse_override(text)
        if section in DEPRECATED_SECTIONS:
            notices.append(f"--set {section}.{key}: [{section}] is now [{DEPRECATED_SECTIONS[section]}]; "
                           f"write --set {DEPRECATED_SECTIONS[section]}.{key}")
            section = DEPRECATED_SECTIONS[section]
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table[key] = value
            from_cli.add(f"{section}.{key}")
    stem = os.path.splitext(os.path.basename(path))[0] if path is not None else "job"
    zero = raw.get("parallel", {}).get("zero") if isinstance(raw.get("parallel"), dict) else None
    if zero is True or zero is False:  # the old boolean key, read as the stage it meant
        notices.append(f"{source}: parallel.zero = {toml_value(zero)} is read as the ZeRO stage {int(zero)}; "
                       f"write parallel.zero = {int(zero)}")
    job = _build(raw, from_cli, source, stem, problems)
    return replace(job, notices=tuple(notices))


def _rename_deprecated_sections(raw: dict, source: str) -> tuple[list[str], list]:
    """Read old section names as the new ones: (notices, problems)."""
    notices, problems = [], []
    for old, new in DEPRECATED_SECTIONS.items():
        if old not in raw:
            continue
        if new in raw:
            problems.append((f"[{old}]", f"is the old name of [{new}], and the file has both; keep [{new}] only"))
            continue
        raw[new] = raw.pop(old)
        notices.append(f"{source}: [{old}] is deprecated and will not be read by the next release; rename it "
                       f"[{new}] (read as [{new}] now)")
    return notices, problems


def _hoist_nested_sections(raw: dict) -> list:
    """``[model.moe]`` read as the section ``moe`` (problems: a ``[moe]`` written at the top)."""
    problems = []
    for name, parent in NESTED_SECTIONS.items():
        if name in raw:
            problems.append((f"[{name}]", f"unknown section; did you mean [{parent}.{name}]?"))
            raw.pop(name)
        if isinstance(raw.get(parent), dict) and name in raw[parent]:
            raw[name] = raw[parent].pop(name)
    return problems


def _build(raw: dict, from_cli: set, source: str, stem: str, problems: list) -> Job:
    """The Job of the raw tables, or a JobError listing ``problems`` and every one found here."""
    def where(dotted):
        return f"{section_title(dotted)} (--set)" if dotted in from_cli else section_title(dotted)

    problems += _misplaced_tables(raw, from_cli)
    sections, given = {}, set()
    for name, cls in SECTIONS.items():
        table = raw.get(name, {}) if isinstance(raw.get(name, {}), dict) else {}
        values = {}
        for key, value in table.items():
            field_name, converted, problem = _convert_key(name, key, value)
            if problem:
                problems.append((where(f"{name}.{key}"), problem))
                continue
            values[field_name] = converted
            given.add(f"{name}.{key}")
        sections[name] = cls(**values)
    job = Job(**sections, source=source, given=frozenset(given))
    problems += [(where(dotted), text) for dotted, text in _without_effect(job)]
    if problems:
        raise JobError(source, problems)
    return _with_paths(job, stem)


def _misplaced_tables(raw: dict, from_cli: set) -> list[tuple[str, str]]:
    """Sections that are not tables, unknown sections, keys outside any section."""
    problems = []
    for name, table in raw.items():
        if name in SECTIONS:
            if not isinstance(table, dict):
                where = f"{name} (--set)" if name in from_cli else name
                problems.append((section_title(where), f"must be a table [{section_title(name)}], got {toml_value(table)}"))
        elif isinstance(table, dict):
            cli = " (--set)" if any(d.startswith(f"{name}.") for d in from_cli) else ""
            problems.append((f"[{name}]{cli}", f"unknown section; {_suggest(name, SECTIONS)}"
                                               f"sections are {', '.join(map(section_title, SECTIONS))}"))
        else:
            owner = [s for s, cls in SECTIONS.items() if name in _fields_by_key(cls)]
            hint = f"did you mean {owner[0]}.{name}? " if owner else ""
            problems.append((name, f"a key outside any section; {hint}keys go under a [section]: "
                                   f"{', '.join(map(section_title, SECTIONS))}"))
    return problems


def _convert_key(section: str, key: str, value) -> tuple[str | None, Any, str | None]:
    """(field name, converted value, None) for a valid key, or (None, None, what is wrong)."""
    known = _fields_by_key(SECTIONS[section])
    if key not in known:
        elsewhere = [s for s, c in SECTIONS.items() if key in _fields_by_key(c)]
        hint = f"did you mean {elsewhere[0]}.{key}? " if elsewhere else _suggest(key, known)
        return None, None, f"unknown key; {hint}[{section_title(section)}] keys are {', '.join(known)}"
    meta = known[key].metadata
    try:
        value = meta["type"].convert(value)
    except (TypeError, ValueError):
        return None, None, f"expected {meta['type'].name}, got {toml_value(value)}"
    if meta["choices"] and value not in meta["choices"]:
        return None, None, (f"{toml_value(value)} is not one of {', '.join(meta['choices'])}; "
                            f"{meta['hint'].get(value, '') or _suggest(value, meta['choices'])}").rstrip("; ")
    if meta["check"] and (failed := meta["check"](value)):
        return None, None, f"{toml_value(value)} {failed}"
    return known[key].name, value, None


def _without_effect(job: Job) -> list[tuple[str, str]]:
    """Keys given a non-default value where another key's value makes them do nothing."""
    problems = []
    for dotted in sorted(job.given):
        section, key = dotted.split(".")
        f = _fields_by_key(SECTIONS[section])[key]
        if not job.applies(dotted) and job.get(dotted) != f.default:
            selector, allowed = f.metadata["applies"]
            selector_title = section_title(selector)
            problems.append((dotted, f"{toml_value(job.get(dotted))} has no effect with {selector_title} = "
                                     f"{toml_value(job.get(selector))}; it applies only with "
                                     f"{applies_text(selector_title, allowed)}: remove it or set {selector_title}"))
    return problems


def _with_paths(job: Job, stem: str) -> Job:
    """Put the job's name in for ``{job}`` in the path keys."""
    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        value = job.get(dotted)
        if isinstance(value, str) and "{job}" in value:
            job = replace(job, **{section: replace(getattr(job, section), **{key: value.replace("{job}", stem)})})
    return job
