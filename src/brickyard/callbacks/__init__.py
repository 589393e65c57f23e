"""Callbacks: the contract (``base``), the built-ins users pass to ``fit`` (one module each), and
brickyard's own behaviours on the same interface (``checkpointing``, ``not_learning``,
``test_every``, ``watching``). See ``brickyard.callbacks.base`` for the hooks and their order."""
from __future__ import annotations

from brickyard.callbacks.base import HOOKS, Callback, CallbackList  # noqa: F401
from brickyard.callbacks.csv_logger import CSVLogger
from brickyard.callbacks.early_stopping import EarlyStopping
from brickyard.callbacks.ema import EMA
from brickyard.callbacks.layer_outputs import LayerOutputs
from brickyard.callbacks.max_time import MaxTime
from brickyard.callbacks.ray_train import RayReport, ray_resume
from brickyard.callbacks.reduce_lr import ReduceLROnPlateau
from brickyard.callbacks.swa import SWA

__all__ = ["Callback", "CallbackList", "CSVLogger", "EarlyStopping", "EMA", "LayerOutputs", "MaxTime", "RayReport",
           "ReduceLROnPlateau", "SWA", "from_config", "ray_resume"]


def from_config(cfg) -> list[Callback]:
    """The built-ins that ``train.*`` keys ask for, so the CLI reaches them too."""
    t, out = cfg.train, []
    if t.early_stopping:
        out.append(EarlyStopping(t.early_stopping_monitor, t.early_stopping, t.early_stopping_min_delta))
    s = cfg.schedule
    if s.name == "plateau":
        out.append(ReduceLROnPlateau(s.monitor, s.gamma, s.patience, s.min_delta, s.cooldown, s.lr_end))
    if t.ema:
        out.append(EMA(t.ema))
    if t.swa.start:
        w = t.swa
        out.append(SWA(w.start, w.lr or None, w.anneal, None if w.every == "auto" else int(w.every), w.bn_update))
    if t.max_time_s:
        out.append(MaxTime(t.max_time_s))
    return out
