"""Each key's own check: a plain value (parsed YAML, a ``--set`` value, a value given to ``Config.replace``)
against the type and bounds its field declares (``schema._opt``), into what the frozen section holds.

``make`` builds a section from a mapping; ``with_changes`` makes a copy of a built section with dotted-key
changes, each new value checked by the same ``field_value``. Neither knows a particular section: the rules
among keys are the sections' own (``check()`` in ``config/schema.py``, ``config/rules.py``).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any, Union

from brickyard.errors import ConfigError

# what a config may hold: far more than any real one, far less than what hangs or overflows the stack
MAX_BYTES, MAX_VALUES, MAX_DEPTH, MAX_BASES = 1 << 20, 100_000, 32, 16
MAX_INT = 2**31 - 1
_BAD = object()


def bounded(value, where: str):
    """``value`` (parsed YAML: a file, or a ``--set`` value) if it holds at most ``MAX_VALUES`` values nested
    at most ``MAX_DEPTH`` deep, counting what YAML aliases repeat as often as they are repeated (an alias
    bomb expands to billions); else a ``ConfigError``. Walks without recursion and stops at the first bound."""
    stack, seen = [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ConfigError(f"{where}: more than {MAX_VALUES:,} values (YAML aliases that repeat a large part?); "
                              f"a config is a few hundred.")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep; a config is 3 or 4.")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if isinstance(k, (tuple, list, dict)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
    return value


def _no_unknown(cls, keys, prefix: str) -> None:
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if key not in fields:
            raise ConfigError(f"{prefix}{key}: unknown key; allowed in this section: {', '.join(fields)}.")


def make(cls, raw, prefix: str):
    """A ``cls`` section from the mapping ``raw``: keys it leaves out take their defaults; an unknown key,
    or a value its field does not allow, is a ``ConfigError`` naming ``prefix`` + the key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {raw!r}.")
    _no_unknown(cls, raw, prefix)
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: field_value(f, hints[f.name], raw[f.name], f"{prefix}{f.name}")
              for f in dataclasses.fields(cls) if f.name in raw}
    return cls(**kwargs)


def field_value(f: dataclasses.Field, tp, value, key: str):
    """What field ``f`` (type ``tp``, named ``key`` in messages) holds for the plain ``value``: a section
    built from a mapping, a tuple of sections from a list of mappings, else the checked value."""
    if dataclasses.is_dataclass(tp):
        return make(tp, value if value is not None else {}, key + ".")
    if f.metadata.get("item") is not None:
        items = value if value is not None else []
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of mappings, got {items!r}.")
        return tuple(make(f.metadata["item"], it, f"{key}[{i}].") for i, it in enumerate(items))
    return check_value(key, value, tp, f.metadata)


def with_changes(section, changes: list[tuple[list[str], Any]], prefix: str = ""):
    """A copy of ``section`` (a frozen dataclass) with ``changes``, ``(path, value)`` pairs applied in order
    as ``--set path=value`` applies to the section's plain mapping: a path into a subsection changes that
    key alone, a whole subsection given as a value replaces it (keys it leaves out take their defaults).
    Every new value passes ``field_value``, in the order of the fields; nothing else is checked again."""
    merged: dict[str, Any] = {}  # field -> a list of deeper changes, or _Whole(value) replacing the field
    for path, value in changes:
        head, rest = path[0], path[1:]
        if not rest:
            merged[head] = _Whole(value)
        elif isinstance(merged.get(head), _Whole):  # into a value given whole: the value changes
            merged[head] = _Whole(_set_in(merged[head].value, rest, value))
        else:
            merged.setdefault(head, []).append((rest, value))
    _no_unknown(type(section), merged, prefix)
    hints = typing.get_type_hints(type(section))
    new = {}
    for f in dataclasses.fields(section):
        change, key = merged.get(f.name), f"{prefix}{f.name}"
        if change is None:
            continue
        current = getattr(section, f.name)
        if isinstance(change, _Whole):
            new[f.name] = field_value(f, hints[f.name], change.value, key)
        elif dataclasses.is_dataclass(current):
            new[f.name] = with_changes(current, change, key + ".")
        else:  # a path below a plain value: the value becomes a mapping, which its check refuses
            plain: dict = {}
            for rest, value in change:
                plain = _set_in(plain, rest, value)
            new[f.name] = field_value(f, hints[f.name], plain, key)
    return dataclasses.replace(section, **new)


@dataclasses.dataclass
class _Whole:
    value: Any


def _set_in(node, path: list[str], value) -> dict:
    """A copy of ``node`` with ``value`` at ``path``, a mapping made of whatever is not one on the way."""
    out = copy.deepcopy(node) if isinstance(node, dict) else {}
    inner = out
    for p in path[:-1]:
        if not isinstance(inner.get(p), dict):
            inner[p] = {}
        inner = inner[p]
    inner[path[-1]] = value
    return out


def type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]  # null is the unset default: not what to write
    if args:
        return " or ".join(type_name(a) for a in args)
    names = {type(None): "null", int: "an integer", float: "a number", bool: "true or false", str: "a string",
             tuple: "a list", list: "a list"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def check_value(key: str, value: Any, tp, meta) -> Any:
    """``value`` as field ``key`` (type ``tp``, ``schema._opt`` metadata ``meta``) holds it, else a
    ``ConfigError`` naming the key, the value and what is allowed."""
    allowed_types = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    coerced = _coerce(value, allowed_types)
    if coerced is _BAD and tuple in allowed_types and isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != "":
        coerced = (value,)  # one item where a list is expected (`--set train.loggers=csv`): a list of one
    if coerced is _BAD:
        raise ConfigError(f"{key}: {value!r} is not {type_name(tp)}.")
    if isinstance(coerced, str) and tuple in allowed_types and coerced not in (meta.get("choices_str") or ()):
        coerced = (coerced,)  # one pattern where a list or a word is allowed: a list of one
    if meta.get("names") and isinstance(coerced, tuple):
        odd = next((v for v in coerced if isinstance(v, bool) or not isinstance(v, (str, int))), None)
        if odd is not None:
            raise ConfigError(f"{key}: {odd!r} is not a name or a pattern, e.g. [conv1, layer1.*].")
        coerced = tuple(str(v) for v in coerced)
    if isinstance(coerced, str) and meta.get("choices_str") and coerced not in meta["choices_str"]:
        raise ConfigError(f"{key}: {value!r} is not a number or one of {', '.join(meta['choices_str'])}.")
    choices = meta.get("choices")
    if choices is not None and coerced not in choices:
        shown = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
        raise ConfigError(f"{key}: {value!r} is not one of {shown}.")
    _check_range(key, value, coerced, meta)
    return coerced


def _check_range(key: str, value, coerced, meta) -> None:
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(coerced, int) and not isinstance(coerced, bool) and hi is None:
        hi = MAX_INT  # what every counter, size and seed here can use (torch and numpy take 32-bit values)
    if isinstance(coerced, (int, float)) and not isinstance(coerced, bool):
        if isinstance(coerced, float) and not math.isfinite(coerced):  # an int is finite (and may exceed a float)
            raise ConfigError(f"{key}: {value!r} is not allowed; give a finite number.")
        if lo is not None and coerced < lo:
            raise ConfigError(f"{key}: {value!r} is below the minimum {lo}.")
        if hi is not None and coerced > hi:
            raise ConfigError(f"{key}: {value!r} is above the maximum {hi}.")


def _number(value) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        number = float(value.strip().replace("_", ""))
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _coerce(value, allowed_types):
    for tp in allowed_types:
        if tp is type(None) and value is None:
            return None
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        number = _number(value)  # YAML 1.1 reads 5e-5 and 1e5 as strings: take them as the numbers they are
        if tp is float and number is not None:
            return number
        if tp is int and number is not None and number.is_integer():
            return int(number)
        if tp is str and isinstance(value, str):
            return value
        if tp in (tuple, list) and isinstance(value, (list, tuple)):
            return tuple(value)
    return _BAD
