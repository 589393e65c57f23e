"""``SWA``: stochastic weight averaging (Izmailov et al., UAI 2018), on ``torch.optim.swa_utils``.

What it follows, read in the sources:
- PyTorch's ``torch/optim/swa_utils.py`` (torch 2.13): the running mean is ``get_swa_multi_avg_fn`` (l. 85-110:
  ``avg += (w - avg) / (n + 1)``, one foreach ``lerp`` for float tensors); ``update_bn`` (l. 372-428) recomputes
  batch norm's statistics with ``momentum=None`` (a cumulative average) over one pass; ``SWALR`` (l. 430-545)
  anneals each rate from the group's current one to ``swa_lr`` with ``(1 - cos(pi t)) / 2`` (l. 503-504) over
  ``anneal_epochs`` and holds it.
- Lightning's ``StochasticWeightAveraging`` (``src/lightning/pytorch/callbacks/stochastic_weight_avg.py``): a start
  as an int (the epoch, counted from 1: ``swa_start = max(swa_epoch_start - 1, 0)``) or a fraction of the run
  (``int(max_epochs * swa_epoch_start)``); one average an epoch, of the parameters; the average copied into the
  model at the end and batch norm recomputed with an extra epoch. It refuses sharded models and evaluates the raw
  weights until the end.

Where this differs, and why: brickyard's runs are counted in steps (1.5 epochs by default), so a fraction below 1
is of the run's steps and the averages come once an epoch or, in a phase shorter than ten epochs, ten times in it
(``every``); the buffers are averaged too (``AveragedModel(use_buffers=True)``), so that validation, ``best.pt``
and the test use the average as ``EMA`` does (Lightning validates the raw weights); batch norm is recomputed for
the average before the last validation (kept beside it: checkpoints keep the average itself, which a resumed run
goes on averaging), so the final weights, their validation and ``best.pt`` agree; the rate
anneals per step, not per epoch. The average is kept in every checkpoint (gathered under FSDP), so a resumed run
ends with the same weights as one that never stopped.
"""
from __future__ import annotations

import math

import torch
from torch.optim.swa_utils import get_swa_multi_avg_fn

from brickyard.callbacks import averaging
from brickyard.callbacks.base import Callback
from brickyard.errors import ConfigError

_average = get_swa_multi_avg_fn()


class SWA(Callback):
    """Stochastic weight averaging from ``start``: a fraction of the run's steps below 1 (0.75: its last quarter),
    else the epoch it begins in, counted from 1 (Lightning's ``swa_epoch_start``). ``lr``: the rate it anneals to
    (cosine, over ``anneal`` of the averaging phase, as ``SWALR``) and then holds; None keeps the run's schedule.
    ``every``: steps between averages (None: once an epoch, or ten times in a shorter phase). ``bn_update``:
    recompute batch norm's statistics for the average before the last validation (``update_bn``)."""

    state_key_fields = ("start",)
    before_checkpoints = True

    def __init__(self, start: float = 0.8, lr: float | None = None, anneal: float = 0.2, every: int | None = None,
                 bn_update: bool = True):
        if not _number(start) or start <= 0 or (start >= 1 and start != int(start)):
            raise ConfigError(f"SWA: start {start} must be a fraction of the run between 0 and 1 (e.g. 0.75) or the "
                              f"epoch to begin in, a whole number from 1.")
        if lr is not None and (not _number(lr) or lr <= 0):
            raise ConfigError(f"SWA: lr {lr} must be a positive rate (e.g. 0.01), or None to keep the schedule's.")
        if not _number(anneal) or not 0 <= anneal <= 1:
            raise ConfigError(f"SWA: anneal {anneal} must be a fraction of the averaging phase between 0 and 1.")
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ConfigError(f"SWA: every {every} must be a whole number of steps of at least 1, or None.")
        self.start, self.lr, self.anneal, self.every, self.bn_update = start, lr, anneal, every, bool(bn_update)
        self.avg: list | None = None
        self.count, self.from_lr = 0, None  # averages taken, the rate it anneals from
        self.fresh: list | None = None  # batch norm's buffers recomputed for the current average (not saved)

    def on_train_start(self, run):
        # the run as planned (train.epochs), so that a run stopped early (max_steps) and resumed averages as one
        total, per_epoch = run.planned_steps or run.total_steps, run.steps_per_epoch
        self.begin = max(1, round(self.start * total) if self.start < 1 else (int(self.start) - 1) * per_epoch)
        if self.begin >= total:
            raise ConfigError(f"SWA: start {self.start} is step {self.begin}, at or past the run's last step ({total}); "
                              f"choose an earlier start.")
        if self.begin >= run.total_steps:
            run.log.warning(f"SWA: its start (step {self.begin} of the {total} planned) comes after this run stops at "
                            f"step {run.total_steps} (train.max_steps or train.stop_epoch): nothing is averaged")
        phase = total - self.begin
        self.spacing = self.every or max(1, min(per_epoch, phase // 10))
        self.anneal_steps = max(1, round(self.anneal * phase))
        params = list(run.model.parameters())
        self.live = params + list(run.model.buffers())
        self.buffers_from = len(params)
        if self.avg is not None:  # resumed: the average the checkpoint kept, laid out as this run's weights
            self.avg = averaging.laid_out(self.avg, self.live, "SWA")
            self.floats, self.counters = averaging.paired(self.avg, self.live)
            run.use_eval_weights(self.applied)
            self._set_lr(run)

    def on_step_end(self, run, loss):
        n = run.step
        if n < self.begin:
            return
        if n == self.begin and self.from_lr is None:
            self.from_lr = run.lr  # the rate it anneals from: the schedule's, at the start (SWALR: the group's)
        if (n - self.begin) % self.spacing == 0:
            self._update()
            run.use_eval_weights(self.applied)
        self._set_lr(run)

    def _update(self) -> None:
        self.fresh = None  # a new average: statistics recomputed for the last one no longer fit
        with torch.no_grad():
            if self.count == 0:
                self.avg = [w.detach().clone() for w in self.live]
                self.floats, self.counters = averaging.paired(self.avg, self.live)
            else:
                for pairs in self.floats:
                    _average([a for a, _ in pairs], [w for _, w in pairs], self.count)
                for a, w in self.counters:
                    a.copy_(w)
        self.count += 1

    def _set_lr(self, run) -> None:
        """The rate of step ``run.step`` (the next): SWALR's cosine from ``from_lr`` to ``lr``, then ``lr``."""
        if self.lr is None or self.from_lr is None:
            return
        t = min(1.0, (run.step - self.begin + 1) / self.anneal_steps)
        alpha = (1 - math.cos(math.pi * t)) / 2
        run.lr_override = self.from_lr * (1 - alpha) + self.lr * alpha

    def on_validation_start(self, run):
        if run.step >= run.total_steps or run.stopped is not None:  # the last: its weights are the run's result
            self._refresh_bn(run)

    def on_loop_end(self, run):
        if self.avg is not None and not run.interrupted:
            self._refresh_bn(run)  # for the test and the final weights: a run without validation data, an early stop

    def on_train_end(self, run, summary):
        if self.avg is None:
            return
        with torch.no_grad():  # the run ends with the averaged weights (the test evaluated them swapped in)
            self._swap_in()
        run.use_eval_weights(None)

    def _refresh_bn(self, run) -> None:
        """Batch norm's statistics for the average (``run.recompute_bn``: every rank, one pass), kept beside it for
        the evaluations and the final weights; the checkpoints keep the average as it was, so a run resumed from
        one averages on as an uninterrupted run does."""
        if self.avg is None or not self.bn_update or self.fresh is not None:
            return
        with self.applied():
            if run.recompute_bn():
                self.fresh = [w.detach().clone() for w in self.live[self.buffers_from:]]
                run.log.info(f"SWA: batch norm's statistics recomputed for the average of {self.count} weights "
                             f"(one pass over the training data)")

    def _swap_in(self) -> None:
        assert self.avg is not None
        averaging.copy(self.live, self.avg)
        averaging.copy(self.live[self.buffers_from:], self.fresh or ())

    def applied(self):
        """Swap the average in (for an evaluation or a save) and the raw weights back after."""
        return averaging.swapped(self.live, self._swap_in)

    def summary(self, run) -> dict:
        return {"swa_averages": self.count}

    def state_dict(self):
        if self.avg is None:
            return {}
        return {"avg": averaging.saved(self.avg), "count": self.count, "from_lr": self.from_lr}

    def load_state_dict(self, state):
        avg = averaging.loaded(state, "SWA")
        if avg is None:
            return
        count, from_lr = state.get("count"), state.get("from_lr")
        if not (isinstance(count, int) and count >= 1 and (from_lr is None or _number(from_lr))):
            raise ValueError(f"SWA: {str(state)[:120]} is not its state")
        self.avg, self.count, self.from_lr = avg, count, from_lr


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
