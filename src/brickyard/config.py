"""One typed, frozen configuration: defaults, then a YAML file, then ``--set`` overrides.

``load_config(source, overrides)`` is the only way a ``Config`` is built from user input.
Every key is checked against the dataclasses below before anything runs: an unknown key, a
wrong type or a value out of range raises ``ConfigError`` with one line naming the key, the
bad value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from brickyard.errors import ConfigError
from brickyard.schema import (BoostConfig, CheckpointConfig, Config, DataConfig, DimReduceConfig, DistConfig,  # noqa: F401
                              FinetuneConfig, ModelConfig, OptimConfig, ParamGroupRule, PSConfig, ScheduleConfig,
                              SnapshotConfig, SyntheticConfig, TrainConfig)

PRESET_DIR = Path(__file__).parent / "presets"


# ---------------------------------------------------------------------------------------------
# Building and validating


def list_presets() -> dict[str, str]:
    """Preset name -> first comment line of its YAML file."""
    out = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        out[path.stem] = first.lstrip("# ").strip()
    return out


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]}).") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}.")
    return data


def load_config(source: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Resolve a preset name or YAML path (default preset ``mnist``) plus ``KEY=VALUE`` overrides."""
    source = source or "mnist"
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {source} does not exist.")
        raw = _read_yaml(path)
        raw.setdefault("preset", path.stem)
    elif (PRESET_DIR / f"{source}.yaml").is_file():
        raw = _read_yaml(PRESET_DIR / f"{source}.yaml")
        raw["preset"] = source
    else:
        names = ", ".join(list_presets())
        raise ConfigError(f"'{source}' is neither a YAML file nor a preset; presets: {names}.")
    base = raw.pop("base", None)
    if base is not None:
        parent = load_config(str(base)).to_dict()
        raw = _deep_merge(parent, raw)
    return build(raw, overrides)


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build(raw: dict, overrides: list[str] | tuple = ()) -> Config:
    raw = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=0.05.")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            child = node.get(p)
            if not isinstance(child, dict):
                child = {}
                node[p] = child
            node = child
        node[parts[-1]] = value
    cfg = _make(Config, raw, "")
    cross_check(cfg)
    return cfg


_SIZED = ("resize", "center_crop", "random_resized_crop")


def _check_transform(key: str, spec) -> None:
    name, _, arg = str(spec).partition(":")
    if name in ("hflip", "grayscale", "rgb") and not arg:
        return
    dims = arg.split("x")
    if name in _SIZED and 1 <= len(dims) <= 2 and all(d.isdigit() and int(d) > 0 for d in dims):
        return
    raise ConfigError(f"{key}: transform {spec!r} is not one of resize:S, center_crop:S, random_resized_crop:S "
                      f"(S a size like 224 or 28x28), hflip, grayscale, rgb.")


def cross_check(cfg: Config) -> None:
    """The checks that involve several keys, when the config is built: before any process starts,
    data loads or training begins."""
    b, o = cfg.boost, cfg.optim
    if len(o.betas) != 2 or not all(isinstance(v, (int, float)) and 0 <= v < 1 for v in o.betas):
        raise ConfigError(f"optim.betas: {list(o.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999].")
    for key in ("train_transforms", "eval_transforms"):
        for spec in getattr(cfg.data, key):
            _check_transform(f"data.{key}", spec)
    if b.dim_reduce.enabled and cfg.train.grad_accum != 1:
        raise ConfigError("boost.dim_reduce works with train.grad_accum: 1 (the line search needs one batch per step).")
    if (b.dim_reduce.enabled or b.snapshots.enabled) and not b.dim_reduce.pca_path and b.snapshots.keep <= b.dim_reduce.n_components:
        raise ConfigError(f"boost.snapshots.keep: {b.snapshots.keep} must exceed boost.dim_reduce.n_components "
                          f"({b.dim_reduce.n_components}); PCA needs more snapshots than components.")
    if b.dim_reduce.enabled and cfg.dist.mode == "ps":
        raise ConfigError("boost.dim_reduce runs in the collective mode (dist.mode: collective).")
    stops = [k for k, on in (("train.early_stopping", cfg.train.early_stopping), ("train.max_time_s", cfg.train.max_time_s)) if on]
    if stops and cfg.dist.mode == "ps" and cfg.dist.ps.sync:
        raise ConfigError(f"{stops[0]}: a synchronous parameter-server run cannot stop before its last step yet; "
                          f"use dist.mode: collective.")


def _make(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {raw!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            allowed = ", ".join(fields)
            raise ConfigError(f"{prefix}{key}: unknown key; allowed in this section: {allowed}.")
    kwargs = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        tp = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _make(tp, raw[name] if raw[name] is not None else {}, key + ".")
        elif f.metadata.get("item") is not None:
            items = raw[name] if raw[name] is not None else []
            if not isinstance(items, (list, tuple)):
                raise ConfigError(f"{key}: expected a list of mappings, got {items!r}.")
            kwargs[name] = tuple(_make(f.metadata["item"], it, f"{key}[{i}].") for i, it in enumerate(items))
        else:
            kwargs[name] = _check(key, raw[name], tp, f.metadata)
    return cls(**kwargs)


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if args:
        return " or ".join(_type_name(a) for a in args)
    names = {type(None): "null", int: "an integer", float: "a number", bool: "true or false", str: "a string",
             tuple: "a list", list: "a list"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _check(key: str, value: Any, tp, meta) -> Any:
    allowed_types = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    coerced = _coerce(value, allowed_types)
    if coerced is _BAD:
        raise ConfigError(f"{key}: {value!r} is not {_type_name(tp)}.")
    if isinstance(coerced, str) and meta.get("choices_str") and coerced not in meta["choices_str"]:
        raise ConfigError(f"{key}: {value!r} is not a number or one of {', '.join(meta['choices_str'])}.")
    choices = meta.get("choices")
    if choices is not None and coerced not in choices:
        shown = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
        raise ConfigError(f"{key}: {value!r} is not one of {shown}.")
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(coerced, (int, float)) and not isinstance(coerced, bool):
        if coerced != coerced or coerced in (float("inf"), float("-inf")):
            raise ConfigError(f"{key}: {value!r} is not allowed; give a finite number.")
        if lo is not None and coerced < lo:
            raise ConfigError(f"{key}: {value!r} is below the minimum {lo}.")
        if hi is not None and coerced > hi:
            raise ConfigError(f"{key}: {value!r} is above the maximum {hi}.")
    return coerced


_BAD = object()


def _number(value) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        number = float(value.strip().replace("_", ""))
    except ValueError:
        return None
    return number if number == number and abs(number) != float("inf") else None


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


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def describe(cls=Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) rows for the config reference in the README and ``--help``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += describe(tp, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = f.metadata.get("doc", "")
        if f.metadata.get("choices"):
            doc = (doc + "; " if doc else "") + "one of " + ", ".join(map(str, f.metadata["choices"]))
        rows.append((prefix + f.name, repr(default), doc))
    return rows


TABLE_START, TABLE_END = "<!-- config table: generated by `python -m brickyard.config`; a test compares -->", "<!-- end of config table -->"


def markdown_table() -> str:
    """The README's configuration reference, from the schema."""
    rows = [TABLE_START, "| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, doc in describe():
        rows.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(rows + [TABLE_END])


def update_readme(path: Path) -> bool:
    """Replace the table between the markers in ``path``; True when the file changed."""
    text = path.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    new = text[:start] + markdown_table() + text[end:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":  # python -m brickyard.config [README.md]: print the table, or rewrite it in the file
    import sys
    if len(sys.argv) > 1:
        print("updated" if update_readme(Path(sys.argv[1])) else "unchanged")
    else:
        print(markdown_table())
