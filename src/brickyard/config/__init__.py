"""One typed, frozen configuration: defaults, then a YAML file, then ``--set`` overrides.

``load_config(source, overrides)`` is the only way a ``Config`` is built from user input.
Every key is checked against the dataclasses below before anything runs: an unknown key, a
wrong type or a value out of range raises ``ConfigError`` with one line naming the key, the
bad value and what is allowed.
"""
from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import yaml

from brickyard.config.checks import cross_check  # noqa: F401
from brickyard.config.schema import (  # noqa: F401
    BoostConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DimReduceConfig,
    DistConfig,
    FinetuneConfig,
    ModelConfig,
    OptimConfig,
    ParamGroupRule,
    PSConfig,
    ScheduleConfig,
    SnapshotConfig,
    SyntheticConfig,
    TrainConfig,
    per_device_wins,
    switch_optimiser,
)
from brickyard.config.values import MAX_BASES, MAX_BYTES, MAX_DEPTH, bounded, make
from brickyard.errors import ConfigError
from brickyard.files import write_atomic, write_if_changed

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


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, except that a key written twice in one mapping is a ``ConfigError``:
    PyYAML keeps the last silently, so a second ``optim:`` section would undo the first without a word."""
    where = ""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"{self.where}: {key} is written twice (lines {seen[key]} and {line}); YAML would "
                                      f"keep only the last, so say it once.")
                seen[key] = line
        return super().construct_mapping(node, deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's problem and where it is (``line 2, column 1: found character '\\t' ...``), with the fix for
    the commonest one, a tab (YAML indents with spaces); its first line where it gives no position."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return str(e).splitlines()[0]
    tab = "; YAML indents with spaces, not tabs" if "'\\t'" in problem else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{tab}"


def parse_yaml(text: str, where: str):
    """``yaml.safe_load`` with the bounds of ``bounded``; a syntax error, a key written twice in one
    mapping or a nesting that overflows the parser is a ``ConfigError`` naming ``where``."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{where}: {len(text):,} characters; a config is a few kilobytes.")
    loader = type("Loader", (_Loader,), {"where": where})
    try:
        return bounded(yaml.load(text, Loader=loader), where)  # noqa: S506  a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({_yaml_problem(e)}).") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep; a config is 3 or 4.") from None


def build(raw: dict, overrides: list[str] | tuple = (), notes: list | None = None) -> Config:
    """The ``Config`` of the plain mapping ``raw`` with ``KEY=VALUE`` overrides (each value read as YAML),
    checked: each key, then each section, then the rules across sections; else a ``ConfigError``."""
    raw = copy.deepcopy(raw)  # overrides must not reach into the caller's nested dicts
    per_device_wins(raw)
    keys = [item.partition("=")[0].strip() for item in overrides]
    per_device_wins(raw, keys)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=0.05.")
        if len(text) > 1 << 16:
            raise ConfigError(f"--set {key.strip()}: a value of {len(text):,} characters; a setting is a few.")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        except RecursionError:
            raise ConfigError(f"--set {key.strip()}: the value is nested too deeply.") from None
        bounded(value, f"--set {key.strip()}")
        if key.strip() == "optim.name" and isinstance(raw.get("optim"), dict):
            switch_optimiser(raw["optim"], value, {k.split(".", 1)[1] for k in keys if k.startswith("optim.")}, "--set", notes)
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            child = node.get(p)
            if not isinstance(child, dict):
                child = {}
                node[p] = child
            node = child
        node[parts[-1]] = value
    cfg = make(Config, raw, "")
    cfg.check()
    return cfg


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}).") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}.")
    return data


def load_config(source: str | None = None, overrides: list[str] | tuple = (), _chain: tuple = (),
                notes: list | None = None) -> Config:
    """Resolve a preset name or YAML path (default preset ``mnist``) plus ``KEY=VALUE`` overrides. A
    ``base:`` names the config this one starts from: a file beside this one, else a preset, else a file
    relative to the working folder. ``notes``, when given, collects what the first log line should say
    about where keys came from (an optimiser changed on a preset gets its own conventions)."""
    source = source or "mnist"
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.is_file():  # a folder named like a preset (./mnist of data) is not a config
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
        if not isinstance(base, str):
            raise ConfigError(f"{source}: base: {base!r} is not a preset name or a YAML file.")
        if path.is_file() and (path.parent / base).is_file():  # a file beside this one (else the working folder's)
            base = str(path.parent / base)
        me = str(path.resolve()) if path.is_file() else source
        chain = _chain + (me,)
        if (str(Path(base).resolve()) if Path(base).is_file() else base) in chain:
            raise ConfigError(f"{source}: base: {base} leads back to itself ({' -> '.join(chain + (base,))}).")
        if len(chain) > MAX_BASES:
            raise ConfigError(f"{source}: more than {MAX_BASES} configs chained by base:.")
        per_device_wins(raw)  # this file's data.batch_size outranks the base's global batch
        parent = load_config(str(base), _chain=chain, notes=notes).to_dict()
        if isinstance(raw.get("optim"), dict) and "name" in raw["optim"]:
            switch_optimiser(parent["optim"], raw["optim"]["name"], set(raw["optim"]), f"{source}, on {base}", notes)
        raw = _deep_merge(parent, raw)
    return build(raw, overrides, notes)


# keys a resumed run may change: how long it trains, what it logs and saves, where and how fast it runs
MAY_CHANGE_ON_RESUME = ("train.epochs", "train.max_steps", "train.stop_epoch", "train.max_time_s", "train.progress", "train.log_every",
                        "train.eval_every", "train.plots", "train.tensorboard", "train.histograms_every", "train.watch",
                        "train.watch_every", "train.device", "train.threads", "train.tune_allocator", "train.csv_log",
                        "checkpoint.", "dist.timeout_s", "dist.strategy", "dist.fsdp.", "dist.pipeline.", "dist.tensor_parallel", "dist.grad_sync", "dist.backend",
                        "train.activation_checkpointing", "data.num_workers", "data.prefetch", "data.pin_memory", "data.eval_limit", "preset")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resume_config(run_dir, source: str | None, overrides=(), auto: bool = True) -> Config:
    """The config a resumed run continues with: the one saved in ``run_dir`` plus ``overrides``. An
    override (or a named config) that would change the run itself is refused, naming the key."""
    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file():
        if source is None and not overrides and auto:  # the default preset would start a run where one was to continue
            raise ConfigError(f"--resume: {run_dir} holds no config.yaml of a run to continue; name the config to start "
                              f"one there (`brickyard train CONFIG --run-dir {run_dir} --resume auto`).")
        return load_config(source or "mnist", overrides)
    saved = _read_yaml(saved_path)
    cfg = build(saved, overrides)
    where = f"the run in {run_dir}"
    check_resumable(saved, cfg, where)
    if source:
        check_resumable(saved, load_config(source, overrides), where)
    return cfg


def check_resumable(saved: dict, cfg: Config, where: str) -> None:
    """Refuse, naming the first key, a ``cfg`` that would change the run ``saved`` (a config dict from a
    run's ``config.yaml`` or a checkpoint) describes beyond ``MAY_CHANGE_ON_RESUME``."""
    try:
        old = _flat(build(saved).to_dict())
    except ConfigError as e:
        raise ConfigError(f"--resume: the config saved in {where} is not one this brickyard can read ({e})") from None
    new = _flat(cfg.to_dict())
    for key in old:
        if key == "optim.lr" and new[key] == "find" and isinstance(old[key], (int, float)):
            continue  # the rate the range test found for this run is the one it resumes with
        if key == "data.task" and "auto" in (new[key], old[key]):
            continue  # auto is what the same data resolves it to (a task the data does not fit is one sentence later)
        if key in new and new[key] != old[key] and not _may_change(key):
            raise ConfigError(f"--resume: {key} is {old[key]!r} in {where}, not {new[key]!r}; a resumed run keeps "
                              f"its config (only how long it trains, what it logs and where it runs may change).")


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE_ON_RESUME)


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_config(cfg: Config, path: Path) -> bool:
    """The resolved config, under a first line that marks it as brickyard's, written atomically and only
    when it changed; True when it wrote."""
    return write_if_changed(path, RESOLVED_HEADER + "\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# the first line of a run directory's config.yaml: what tells brickyard's resolved dump from a user's file
RESOLVED_HEADER = "# the resolved config of this run, written by brickyard (load it with `brickyard train THIS_FILE`)"


def describe(cls=Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) rows for the configuration reference (``docs/configuration.md``)."""
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


TABLE_START, TABLE_END = "<!-- config table: generated by `python -m brickyard.config docs/configuration.md`; a test compares -->", "<!-- end of config table -->"


def markdown_table() -> str:
    """The configuration reference table (``docs/configuration.md``), from the schema."""
    rows = [TABLE_START, "| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, doc in describe():
        rows.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(rows + [TABLE_END])


def update_reference(path: Path) -> bool:
    """Replace the table between the markers in ``path``; True when the file changed."""
    text = path.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    new = text[:start] + markdown_table() + text[end:]
    write_atomic(path, new)
    return new != text
