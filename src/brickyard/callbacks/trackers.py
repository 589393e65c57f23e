"""``Trackers``: the run in the experiment trackers teams already run, as ``train.loggers`` asks
(``mlflow``, ``wandb``). Rank 0 only.

What goes in, for each: the resolved config as parameters (flattened, ``optim.lr``), every row of
``metrics.jsonl`` that carries numbers (train loss and accuracy at the log steps, validation and test
metrics) with its step, and at the end the run directory's files (``config.yaml``, ``summary.json``,
``env.json``, ``metrics.jsonl``, the plots) as artifacts. A resumed run continues the same tracker run:
its id is kept in ``RUN_DIR/trackers.json``.

- **MLflow** (``pip install 'brickyard[mlflow]'``): follows ``MLFLOW_TRACKING_URI`` (a local store
  such as ``sqlite:///mlflow.db``, or a tracking server; MLflow 3 refuses new runs in a ``./mlruns``
  file store) and ``MLFLOW_EXPERIMENT_NAME`` (default ``brickyard``); as Lightning's
  ``MLFlowLogger`` and Accelerate's ``MLflowTracker`` do, through the ``mlflow`` client API.
- **Weights & Biases** (``pip install 'brickyard[wandb]'``): ``wandb.init`` with ``resume="allow"``
  and the saved id, so it follows ``WANDB_MODE`` (``offline`` writes under ``WANDB_DIR``, default the
  run directory), ``WANDB_PROJECT`` (default ``brickyard``), ``WANDB_ENTITY`` and the rest of its
  environment.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from brickyard.callbacks.base import Callback
from brickyard.errors import BrickyardError, ConfigError, reason
from brickyard.files import write_json

TRACKERS = ("mlflow", "wandb")
_EXTRA = {"mlflow": "mlflow", "wandb": "wandb"}
_NUMBERS = {"train": ("loss", "accuracy", "lr", "images_per_second"), "val": ("loss", "accuracy", "top5"),
            "test": ("loss", "accuracy", "top5")}
_ARTIFACTS = ("config.yaml", "summary.json", "env.json", "metrics.jsonl", "metrics.csv")


def check_installed(names) -> None:
    """One sentence naming the pip extra for a tracker whose package is missing (before the run starts)."""
    for name in names:
        if name in TRACKERS and importlib.util.find_spec(_EXTRA[name]) is None:
            raise ConfigError(f"train.loggers: {name} needs the {name} package: pip install 'brickyard[{name}]'.")


def check_reachable(names, timeout: float = 10.0) -> None:
    """A tracking server that takes no connection is one sentence before the run starts, not minutes of the
    client's retries: MLflow's (an ``http(s)://`` tracking URI) retries a refused connection for about four
    minutes (seven retries with a backoff factor of 2); W&B's ``wandb.init`` in online mode for about 100 s
    (measured: wandb 0.31, ``WANDB_BASE_URL`` a closed loopback port, an API key set) before its
    "Timed out while retrying". Only the connection is tried (not where a proxy from
    ``HTTP_PROXY``/``HTTPS_PROXY`` carries the requests); the clients' own retries still cover a server
    that goes away later."""
    if "mlflow" in names:
        import mlflow  # optional dependency; get_tracking_uri follows MLFLOW_TRACKING_URI and mlflow.set_tracking_uri
        uri = mlflow.get_tracking_uri()
        why = _unreachable(uri, timeout)
        if why:
            raise ConfigError(f"train.loggers: mlflow: no tracking server answers at {uri} ({why}); start it, or point "
                              f"MLFLOW_TRACKING_URI at one (a local store: sqlite:///mlflow.db).")
    if "wandb" in names:
        import wandb  # optional dependency; setup() reads WANDB_MODE, WANDB_BASE_URL and `wandb login --host`'s settings
        settings = wandb.setup().settings
        if settings.mode not in ("online", "run"):
            return  # offline, disabled, dryrun: nothing to reach
        why = _unreachable(settings.base_url, timeout)
        if why:
            raise ConfigError(f"train.loggers: wandb: no W&B server answers at {settings.base_url} ({why}); set "
                              f"WANDB_MODE=offline to keep the run under RUN_DIR/wandb and `wandb sync` it later, or "
                              f"WANDB_BASE_URL to your server.")


def _unreachable(uri: str, timeout: float) -> str | None:
    """Why an ``http(s)://`` ``uri`` takes no TCP connection, or None: it does, it is no URL of that kind,
    or a proxy would carry the requests (HTTP(S)_PROXY and not NO_PROXY)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname or ""):
        return None  # the client reaches it through the proxy, which a direct connection would not try
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return None
    except (OSError, ValueError) as e:
        return getattr(e, "strerror", None) or reason(e, 240, joined=True)


def saved_ids(path: Path) -> dict[str, str]:
    """The tracker run ids a run directory keeps (``trackers.json``: ``{"mlflow": ID, "wandb": ID}``);
    a file that is not that is one sentence, and it is left as it is."""
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        saved = None
    if not isinstance(saved, dict) or not all(isinstance(v, str) and v for v in saved.values()):
        raise BrickyardError(f"{path} is not a record of tracker run ids ({{\"mlflow\": \"ID\", ...}}); delete it "
                             f"to start new tracker runs, or put back the ids of the runs to continue.")
    return saved


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


def metrics_of(record: dict) -> dict[str, float]:
    """``{kind_name: value}`` of a ``metrics.jsonl`` row worth tracking (``val_accuracy``)."""
    kind = record.get("kind")
    return {f"{kind}_{k}": float(record[k]) for k in _NUMBERS.get(kind, ())
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}


class _MLflow:
    def __init__(self, run_dir: Path, saved: str | None):
        import mlflow  # optional dependency (brickyard[mlflow]), loaded when a run asks for it
        self.mlflow = mlflow
        if saved:
            try:
                self.run = mlflow.start_run(run_id=saved)
            except Exception as e:  # noqa: BLE001  most often another store than the run's (MLFLOW_TRACKING_URI changed)
                raise BrickyardError(f"the run {saved} that {run_dir / 'trackers.json'} names is not there ({reason(e, 120, joined=True)}); "
                                     f"point MLFLOW_TRACKING_URI at the store this run used, or delete its entry in "
                                     f"trackers.json to start a new MLflow run") from None
        else:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "brickyard"))
            self.run = mlflow.start_run(run_name=run_dir.name)
        self.id = self.run.info.run_id
        self.logged = set(self.run.data.params) if saved else set()

    def params(self, flat: dict) -> None:
        # MLflow keeps a parameter's first value: a resumed run (which may train longer, log elsewhere)
        # adds only the keys it did not log before
        items = [(k, v) for k, v in flat.items() if k not in self.logged]
        for i in range(0, len(items), 100):  # the REST API takes at most 100 a call
            self.mlflow.log_params({k: str(v)[:6000] for k, v in items[i:i + 100]})

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def artifact(self, path: Path) -> None:
        self.mlflow.log_artifact(str(path))

    def finish(self, ok: bool) -> None:
        self.mlflow.end_run(status="FINISHED" if ok else "FAILED")


class _Wandb:
    def __init__(self, run_dir: Path, saved: str | None):
        import wandb  # optional dependency (brickyard[wandb]), loaded when a run asks for it
        self.wandb = wandb
        self.id = saved or uuid.uuid4().hex[:12]  # a W&B run id: letters and digits
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "brickyard"), name=run_dir.name, id=self.id,
                              resume="allow", dir=os.environ.get("WANDB_DIR", str(run_dir)), reinit="finish_previous")
        self.run_dir = run_dir

    def params(self, flat: dict) -> None:
        self.run.config.update(flat, allow_val_change=True)

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def artifact(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(self.run_dir.parent), policy="now")  # RUN/config.yaml: not W&B's own config.yaml

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _guard(name: str, fn, *args):
    """A tracker's call; its failure (a server gone, a full disk) is one sentence naming the tracker."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  the tracker's own reason
        raise BrickyardError(f"train.loggers: {name} failed: {reason(e, 240, joined=True)}") from e


class Trackers(Callback):
    """The trackers ``names`` asks for, fed from ``metrics`` (a ``MetricsWriter``) on rank 0."""

    def __init__(self, names, metrics):
        self.names, self.metrics, self.open, self.step = [n for n in names if n in TRACKERS], metrics, [], 0

    def on_train_start(self, run):
        if run.rank != 0 or not self.names:
            return
        path = Path(run.run_dir) / "trackers.json"
        saved = saved_ids(path)
        kinds = {"mlflow": _MLflow, "wandb": _Wandb}
        for name in self.names:
            try:
                self.open.append((name, kinds[name](Path(run.run_dir), saved.get(name))))
            except Exception as e:  # noqa: BLE001  the tracker's own reason, in one sentence
                where = {"mlflow": f" at {os.environ.get('MLFLOW_TRACKING_URI', 'the default tracking URI')}",
                         "wandb": f" (WANDB_MODE={os.environ.get('WANDB_MODE', 'online')})"}[name]
                why = str(e) if isinstance(e, BrickyardError) else reason(e, 240, joined=True)
                raise BrickyardError(f"train.loggers: {name} could not start a run{where}: {why}") from None
        write_json(path, {**saved, **{name: t.id for name, t in self.open}})
        flat = _flat(run.config.to_dict())
        for name, t in self.open:
            _guard(name, t.params, flat)
        self.metrics.listeners.append(self.row)

    def row(self, record: dict) -> None:
        values = metrics_of(record)
        if values and isinstance(record.get("step"), int):
            self.step = max(self.step, record["step"])
            for name, t in self.open:
                _guard(name, t.log, values, self.step)

    def on_train_end(self, run, summary):
        if not self.open:
            return
        folder = Path(run.run_dir)
        files = [folder / n for n in _ARTIFACTS] + sorted(folder.glob("*.png"))  # the plots
        for name, t in self.open:
            for f in files:
                if f.is_file():
                    _guard(name, t.artifact, f)
            _guard(name, t.finish, True)
        self.metrics.listeners.remove(self.row)
        self.open = []
