"""``NotLearning``: a classifier whose loss sits at chance is said to be stuck, once."""
from __future__ import annotations

import math

from brickyard.callbacks.base import Callback
from brickyard.errors import BrickyardError


class NotLearningError(BrickyardError):
    exit_code = 1


MIN_STUCK_STEPS = 12  # and never for fewer steps than this (train.log_every: auto logs a short run every step)


class NotLearning(Callback):
    """Says so when a classifier stops learning: the training loss within 3% of ln(classes) or the
    accuracy within 1.5x of chance for ``windows`` log windows in a row spanning at least a tenth of the run and
    ``MIN_STUCK_STEPS``, after the first tenth of the run. One warning, recorded in the summary; ``train.stop_if_not_learning`` ends the run
    there (exit code 1, the checkpoints already written kept). Reads ``run.train_loss`` and
    ``run.train_accuracy``, which the trainer sets at log steps before any ``on_step_end``: no host sync of its own."""

    def __init__(self, windows: int = 3, stop: bool = False):
        self.windows, self.stop, self.streak, self.said = windows, stop, 0, None
        self.stuck_steps = 0  # the steps the streak's windows span

    def summary(self, run) -> dict:
        return {"not_learning": self.said}

    def state_dict(self):
        """The streak and what was said, so a resumed run warns (or stops) where an uninterrupted one does."""
        return ({"streak": self.streak, "said": self.said, "stuck_steps": self.stuck_steps}
                if self.streak or self.said else {})

    def load_state_dict(self, state):
        streak, said, steps = state.get("streak", 0), state.get("said"), state.get("stuck_steps", 0)
        if not (all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (streak, steps))
                and (said is None or isinstance(said, str))):
            raise ValueError(f"NotLearning: {str(state)[:120]} is not its state")
        self.streak, self.said, self.stuck_steps = streak, said, steps

    def on_step_end(self, run, loss):
        every = int(run.config.train.log_every)  # resolved before the run starts
        c = run.data.num_classes
        if not (run.step % every == 0 or run.step == run.total_steps) or c < 2 or not run.meter.classifies:
            return
        if run.step < run.total_steps / 10:
            return
        chance_loss = math.log(c)
        acc = run.train_accuracy
        stuck = abs(run.train_loss - chance_loss) < 0.03 * chance_loss or (acc is not None and acc < 1.5 / c)
        self.streak = self.streak + 1 if stuck else 0
        self.stuck_steps = self.stuck_steps + every if stuck else 0
        if self.streak < self.windows or self.stuck_steps < max(MIN_STUCK_STEPS, run.total_steps / 10) or self.said:
            return
        self.said = (f"not learning: for {self.streak} log windows up to step {run.step} the training loss is "
                     f"{run.train_loss:.3f} (chance: ln {c} = {chance_loss:.3f}) and the accuracy {acc:.3f} (chance "
                     f"{1 / c:.3f}); likely causes: a learning rate too high for this batch ({run.lr:.4g} now; try "
                     f"a lower optim.lr or a longer warm-up), ReLUs that died early, or labels that do not match the inputs")
        if self.stop:
            raise NotLearningError(self.said + "; stopped (train.stop_if_not_learning).")
        run.log.warning(self.said + ".")
