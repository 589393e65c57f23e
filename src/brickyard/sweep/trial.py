"""One trial of a sweep: an ordinary run directory, trained as ``brickyard train`` trains it, and ``Report``, the
callback through which its validations reach Optuna.

A trial's run learns that it is one from ``BRICKYARD_TRIAL`` (the storage, the study, the trial and the metric, as
JSON), set by the sweep around the run: in this process for a trial of one process, inherited by torchrun's workers
for a trial of several, where rank 0 alone reports (the other ranks' values are the same: validation is gathered).
A trial the pruner stops ends through the ordinary stop path (``run.stop``: a checkpoint, the test, the summary);
its summary's ``stopped`` says so.

The value of a trial is the best of its validations' metric (the one ``best.pt`` keeps: ``checkpoint.monitor`` is set
to it), the lowest for a loss and the highest for a score.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from brickyard.callbacks.base import Callback, monitored

ENV = "BRICKYARD_TRIAL"
PRUNED = "pruned by the sweep"


class Report(Callback):
    """Tells the Optuna trial each validation's ``metric`` (at the hundredths of an epoch it was taken: 100 after the
    first epoch) and stops the run when the study's pruner says so. Rank 0 only; the stop reaches every rank through
    the run's stop vote."""

    def __init__(self, storage: str, study: str, trial_id: int, metric: str, pruner: tuple = ("median", 5, 0.0)):
        self.where, self.study_name, self.trial_id, self.metric = storage, study, trial_id, metric
        self.pruner = tuple(pruner)  # (name, startup trials, warm-up epochs): the sweep process's, not the storage's
        self.trial = None

    def on_train_start(self, run):
        if run.rank != 0:
            return
        from brickyard.sweep.study import open_storage, optuna_module, pruner_of  # only a sweep's runs load Optuna
        optuna = optuna_module()
        study = optuna.load_study(study_name=self.study_name, storage=open_storage(self.where), pruner=pruner_of(*self.pruner))
        self.trial = optuna.trial.Trial(study, self.trial_id)

    def on_validation_end(self, run, metrics):
        if self.trial is None:
            return
        value = monitored(metrics, self.metric, f"brickyard sweep --metric {self.metric}")
        # at hundredths of an epoch, not steps: trials of other batch sizes or data compare at the same point
        self.trial.report(value, round(100 * run.step / max(run.steps_per_epoch, 1)))
        # the last validation is reported, never judged: a trial that trained to its end is complete (pruning it there
        # saves nothing and hides a finished value; the fashion sweep pruned one at its last step, 0.02 below the median)
        if run.step < run.total_steps and self.trial.should_prune():
            run.log.info(f"{PRUNED}: {self.metric} {value:.4f} at step {run.step} is below what the pruner keeps")
            run.stop(f"{PRUNED} at step {run.step}")


def from_env() -> list:
    """The ``Report`` of the trial this process runs (``BRICKYARD_TRIAL``), else nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return []
    s = json.loads(spec)
    return [Report(s["storage"], s["study"], int(s["trial_id"]), s["metric"], s["pruner"])]


@contextlib.contextmanager
def reporting(storage: str, study: str, trial_id: int, metric: str, pruner: tuple):
    """``BRICKYARD_TRIAL`` set for the runs of the ``with`` block (and the workers they start)."""
    os.environ[ENV] = json.dumps({"storage": storage, "study": study, "trial_id": trial_id, "metric": metric,
                                  "pruner": list(pruner)})
    try:
        yield
    finally:
        os.environ.pop(ENV, None)


def best_value(run_dir: Path, metric: str) -> float | None:
    """The best of ``metric`` over the validations the run wrote (``metrics.jsonl``), None where it has none."""
    key, values = metric[len("val_"):], []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "val" and isinstance(row.get(key), (int, float)):
            values.append(float(row[key]))
    if not values:
        return None
    return min(values) if metric.endswith("loss") else max(values)


def summary_of(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
