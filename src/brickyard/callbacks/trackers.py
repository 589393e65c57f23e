"""The experiment trackers (``mlflow``, ``wandb``) are loggers now: ``brickyard.observe.loggers.trackers``. This
module keeps the names it had for their checks."""
from __future__ import annotations

from brickyard.observe.loggers import check as check_installed
from brickyard.observe.loggers.trackers import TRACKERS, check_reachable, metrics_of, saved_ids

__all__ = ["TRACKERS", "check_installed", "check_reachable", "metrics_of", "saved_ids"]
