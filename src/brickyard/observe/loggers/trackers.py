"""The experiment trackers teams already run, as loggers: ``mlflow`` and ``wandb`` (rank 0 only).

What goes in, for each: the resolved config as parameters (flattened, ``optim.lr``), every row that carries
numbers (train loss and accuracy at the log steps, validation and test metrics) with its step, and at the end of a
run that finished the run directory's files (``config.yaml``, ``summary.json``, ``env.json``, ``metrics.jsonl``,
the plots) as artifacts. A resumed run continues the same tracker run: its id is kept in ``RUN_DIR/trackers.json``.

Both talk to a server outside the process, so both run on a thread of their own under a time bound
(``timeout_s``, ``$BRICKYARD_LOGGER_TIMEOUT_S``; ``observe.loggers.fanout``): a server that fails or stalls
mid-run is dropped with one warning and training goes on; a stop is never held up by one.

- **MLflow** (``pip install 'brickyard[mlflow]'``): follows ``MLFLOW_TRACKING_URI`` (a local store
  such as ``sqlite:///mlflow.db``, or a tracking server; MLflow 3 refuses new runs in a ``./mlruns``
  file store) and ``MLFLOW_EXPERIMENT_NAME`` (default ``brickyard``); as Lightning's
  ``MLFlowLogger`` and Accelerate's ``MLflowTracker`` do, through the ``mlflow`` client API. Its fluent API keeps
  the active run per thread, so every call of one run is made on that logger's own thread.
- **Weights & Biases** (``pip install 'brickyard[wandb]'``): ``wandb.init`` with ``resume="allow"``
  and the saved id, so it follows ``WANDB_MODE`` (``offline`` writes under ``WANDB_DIR``, default the
  run directory), ``WANDB_PROJECT`` (default ``brickyard``), ``WANDB_ENTITY`` and the rest of its
  environment.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from brickyard.errors import BrickyardError, ConfigError, reason
from brickyard.files import write_json
from brickyard.observe.loggers import QUOTED, Logger, RunInfo

TRACKERS = ("mlflow", "wandb")
TIMEOUT_S = 30.0  # a tracker call that takes longer (a server that accepts and never answers) drops the tracker
# starting (importing the client, MLflow's first migration of a SQLite store: 10-25 s on 2 busy cores, W&B's init,
# which allows itself 90 s) and the uploads at the end get longer
START_TIMEOUT_S = 120.0
_NUMBERS = {"train": ("loss", "accuracy", "lr", "images_per_second"), "val": ("loss", "accuracy", "top5", *QUOTED),
            "test": ("loss", "accuracy", "top5", *QUOTED)}
_ARTIFACTS = ("config.yaml", "summary.json", "env.json", "metrics.jsonl", "metrics.csv")
_IDS = threading.Lock()  # trackers.json: each tracker's thread adds its own id


def check_reachable(names, timeout: float = 10.0) -> None:
    """A tracking server that takes no connection is one sentence before the run starts, not minutes of the
    client's retries: MLflow's (an ``http(s)://`` tracking URI) retries a refused connection for about four
    minutes (seven retries with a backoff factor of 2); W&B's ``wandb.init`` in online mode for about 100 s
    (measured: wandb 0.31, ``WANDB_BASE_URL`` a closed loopback port, an API key set) before its
    "Timed out while retrying". Only the connection is tried (not where a proxy from
    ``HTTP_PROXY``/``HTTPS_PROXY`` carries the requests); a server that takes the connection and then does not
    answer is the time bound's (``observe.loggers.fanout``)."""
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


def metrics_of(record: dict) -> dict[str, float]:
    """``{kind_name: value}`` of a row worth tracking (``val_accuracy``)."""
    kind = record.get("kind")
    return {f"{kind}_{k}": float(record[k]) for k in _NUMBERS.get(kind, ())
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}


class _Tracker(Logger):
    """What MLflow and W&B share: the saved id, the parameters, the rows with numbers, the artifacts."""

    timeout_s, start_timeout_s = TIMEOUT_S, START_TIMEOUT_S

    def start(self, run: RunInfo) -> None:
        self.run_dir, self.step = Path(run.run_dir), 0
        record = self.run_dir / "trackers.json"
        saved = saved_ids(record).get(self.name)
        try:
            self.open(saved)
        except Exception as e:  # noqa: BLE001  the tracker's own reason, in one sentence
            why = str(e) if isinstance(e, BrickyardError) else reason(e, 240, joined=True)
            raise BrickyardError(f"train.loggers: {self.name} could not start a run{self.where()}: {why}") from None
        self.params(run.hyperparameters)
        self.recorded = False

    def log(self, row: dict) -> None:
        if not self.recorded:  # at the run's first row: a start refused later (another logger's) leaves no record
            with _IDS:
                record = self.run_dir / "trackers.json"
                write_json(record, {**saved_ids(record), self.name: self.id})
            self.recorded = True
        values = metrics_of(row)
        if values and isinstance(row.get("step"), int):
            self.step = max(self.step, row["step"])
            self.values(values, self.step)

    def finish(self, ok: bool) -> None:
        if ok:
            files = [self.run_dir / n for n in _ARTIFACTS] + sorted(self.run_dir.glob("*.png"))  # the plots
            for f in files:
                if f.is_file():
                    self.artifact(f)
        self.end(ok)

    # what each tracker does its own way
    def open(self, saved: str | None) -> None: ...
    def where(self) -> str: ...
    def params(self, flat: dict) -> None: ...
    def values(self, values: dict, step: int) -> None: ...
    def artifact(self, path: Path) -> None: ...
    def end(self, ok: bool) -> None: ...


class MLflow(_Tracker):
    name = "mlflow"

    def open(self, saved: str | None) -> None:
        import mlflow  # optional dependency (brickyard[mlflow]), loaded when a run asks for it
        self.mlflow = mlflow
        if saved:
            try:
                self.run = mlflow.start_run(run_id=saved)
            except Exception as e:  # noqa: BLE001  most often another store than the run's (MLFLOW_TRACKING_URI changed)
                raise BrickyardError(f"the run {saved} that {self.run_dir / 'trackers.json'} names is not there "
                                     f"({reason(e, 120, joined=True)}); point MLFLOW_TRACKING_URI at the store this run "
                                     f"used, or delete its entry in trackers.json to start a new MLflow run") from None
        else:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "brickyard"))
            self.run = mlflow.start_run(run_name=self.run_dir.name)
        self.id = self.run.info.run_id
        self.logged = set(self.run.data.params) if saved else set()

    def where(self) -> str:
        return f" at {os.environ.get('MLFLOW_TRACKING_URI', 'the default tracking URI')}"

    def params(self, flat: dict) -> None:
        # MLflow keeps a parameter's first value: a resumed run (which may train longer, log elsewhere)
        # adds only the keys it did not log before
        items = [(k, v) for k, v in flat.items() if k not in self.logged]
        for i in range(0, len(items), 100):  # the REST API takes at most 100 a call
            self.mlflow.log_params({k: str(v)[:6000] for k, v in items[i:i + 100]})

    def values(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def artifact(self, path: Path) -> None:
        self.mlflow.log_artifact(str(path))

    def end(self, ok: bool) -> None:
        self.mlflow.end_run(status="FINISHED" if ok else "FAILED")


class Wandb(_Tracker):
    name = "wandb"

    def open(self, saved: str | None) -> None:
        import wandb  # optional dependency (brickyard[wandb]), loaded when a run asks for it
        folder = os.environ.get("WANDB_DIR") or str(self.run_dir)
        try:
            os.makedirs(folder, exist_ok=True)  # as wandb does
            usable = os.access(folder, os.W_OK | os.X_OK)
        except OSError:
            usable = False
        if not usable:  # wandb itself would write to a fallback folder and say nothing
            raise BrickyardError(f"WANDB_DIR={folder} is not a folder this process can write to; point WANDB_DIR at one")
        self.id = saved or uuid.uuid4().hex[:12]  # a W&B run id: letters and digits
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "brickyard"), name=self.run_dir.name, id=self.id,
                              resume="allow", dir=folder, reinit="finish_previous")

    def where(self) -> str:
        return f" (WANDB_MODE={os.environ.get('WANDB_MODE', 'online')})"

    def params(self, flat: dict) -> None:
        self.run.config.update(flat, allow_val_change=True)

    def values(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def artifact(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(self.run_dir.parent), policy="now")  # RUN/config.yaml: not W&B's own config.yaml

    def end(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
