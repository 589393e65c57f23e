"""What a sweep answers, at its end and on ``brickyard sweep --show DIR``: the best trial's values and metric, a table
of the trials (``trials.csv`` too), the metric by trial (``sweep.png``), each parameter's importance
(``importance.png``: Optuna's fANOVA where scikit-learn is installed, else its PED-ANOVA), the best trials' curves
overlaid (``best-curves/``, as ``brickyard plot`` draws them), and ``best.yaml``: the best trial's config, which
``brickyard train best.yaml`` takes."""
from __future__ import annotations

import csv
import io
import warnings
from pathlib import Path

import yaml

from brickyard.files import write_atomic
from brickyard.sweep.study import optuna_module


def rows(study) -> list[dict]:
    """One row a trial: number, state, value, seconds, its values, its run directory, why it failed."""
    out = []
    for t in study.get_trials(deepcopy=False):
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and t.datetime_start else None
        value = t.value if t.value is not None else (  # a pruned trial: its last report; a failed one has none
            t.intermediate_values[max(t.intermediate_values)] if t.state.name == "PRUNED" and t.intermediate_values else None)
        out.append({"trial": t.number, "state": t.state.name.lower(), "value": value, "seconds": seconds,
                    **t.params, "spread": t.user_attrs.get("spread"), "run_dir": t.user_attrs.get("run_dir"),
                    "error": t.user_attrs.get("error")})
    return out


def table(study, metric: str) -> str:
    """The trials as aligned text, the best marked."""
    keys = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    best = _best(study)
    lines = [" ".join([f"{'trial':>5}", f"{'state':<9}", f"{metric:>20}", *(f"{k:>16}" for k in keys), "  seconds"])]
    for r in rows(study):
        v = f"{r['value']:.4f}" if isinstance(r["value"], float) else "-"
        v += f" ±{r['spread']:.4f}" if isinstance(r["spread"], float) else ""  # the folds' standard deviation
        cells = [f"{_short(r.get(k)):>16}" for k in keys]
        secs = f"{r['seconds']:9.1f}" if r["seconds"] is not None else f"{'-':>9}"
        mark = " *" if best is not None and r["trial"] == best.number else ""
        lines.append(" ".join([f"{r['trial']:>5}", f"{r['state']:<9}", f"{v:>20}", *cells, secs]) + mark
                     + (f"  ({r['error']})" if r["error"] else ""))
    return "\n".join(lines)


def _short(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)[:16]


def _best(study):
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


def write(study, sweep_dir: Path, metric: str) -> list[Path]:
    """The files of the module docstring (those the trials allow); the paths written."""
    from brickyard.observe import plots  # Pillow and torch: for the answer only
    written = [_csv(study, sweep_dir / "trials.csv")]
    lower = metric.endswith("loss")
    finished = [(r["trial"], r["value"], r["state"]) for r in rows(study)
                if r["state"] in ("complete", "pruned") and isinstance(r["value"], float)]
    if finished:
        written.append(plots.sweep_trials(finished, metric, sweep_dir / "sweep.png", lower))
    importance = _importance(study)
    if importance:
        written.append(plots.importance_bars(importance, sweep_dir / "importance.png"))
    best = _best(study)
    if best is not None and best.user_attrs.get("run_dir"):
        run = Path(best.user_attrs["run_dir"])
        config = run / "config.yaml" if (run / "config.yaml").is_file() else run / "fold-0" / "config.yaml"
        if config.is_file():
            cfg = yaml.safe_load(config.read_text())
            cfg.get("data", {}).pop("fold", None)
            cfg.get("data", {}).pop("folds", None)
            written.append(write_atomic(sweep_dir / "best.yaml", f"# the best trial of {sweep_dir.name}: trial "
                                        f"{best.number}, {metric} {best.value:.4f}\n" + yaml.safe_dump(cfg, sort_keys=False)))
        tops = sorted((t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE" and t.user_attrs.get("run_dir")),
                      key=lambda t: t.value if lower else -t.value)[:3]
        dirs = [Path(t.user_attrs["run_dir"]) for t in tops if (Path(t.user_attrs["run_dir"]) / "metrics.jsonl").is_file()]
        if dirs:
            written += plots.plot_runs(dirs, sweep_dir / "best-curves")
    return written


def _csv(study, path: Path) -> Path:
    data = rows(study)
    keys = list(dict.fromkeys(k for r in data for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys or ["trial"])
    w.writeheader()
    w.writerows(data)
    return write_atomic(path, buf.getvalue())


def _importance(study) -> dict:
    """Each parameter's importance, where two complete trials or more vary it; {} otherwise."""
    optuna = optuna_module()
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    varied = [k for k in {k for t in done for k in t.params} if len({repr(t.params.get(k)) for t in done}) > 1]
    if len(done) < 2 or not varied:
        return {}
    try:
        import sklearn  # noqa: F401  fANOVA's forest; without it, PED-ANOVA (Optuna's own)
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
    except ImportError:
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's experimental-feature notices
        try:
            return dict(optuna.importance.get_param_importances(study, evaluator=evaluator, params=sorted(varied)))
        except (RuntimeError, ValueError):
            return {}
