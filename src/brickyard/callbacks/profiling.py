"""``Profiling``: ``train.profile_steps: [a, b]`` records steps a to b - 1 with ``torch.profiler``
(``brickyard.observe.profiling``) into ``RUN_DIR/profile`` (or ``train.profile_dir``), on every rank.

The log says where the trace is once it is written: when step b - 1 ends, or at the loop's end for a run
that stopped inside the range (the steps it did record). A range the run took no step of (it ended before
step a, or was resumed past step b - 1) is a warning at the loop's end: nothing was recorded."""
from __future__ import annotations

from brickyard.callbacks.base import Callback
from brickyard.observe.profiling import StepProfiler


class Profiling(Callback):
    def __init__(self, first: int, last: int, out_dir, rank: int, device):
        self.profiler = StepProfiler(first, last, out_dir, rank, device)
        self._said = False
        self._steps: tuple[int, int] | None = None  # the first and the last step this run took

    def on_step_start(self, run):
        self._steps = (self._steps or (run.step, run.step))[0], run.step
        self.profiler.step_start(run.step)

    def on_step_end(self, run, loss):
        self.profiler.step_end(run.step - 1)  # the step that ended (run.step counts the steps done)
        self._say(run)

    def on_loop_end(self, run):
        self.profiler.close()
        self._say(run)
        p = self.profiler
        if p.path is None and p.began is None:
            took = f"steps {self._steps[0]}-{self._steps[1]}" if self._steps else "no step"
            run.log.warning(f"train.profile_steps [{p.first}, {p.last}]: this run took {took}, none of steps "
                            f"{p.first}-{p.last - 1}; nothing was recorded.")

    def _say(self, run) -> None:
        p = self.profiler
        if p.path is not None and not self._said:
            self._said = True
            run.log.info(f"profile of steps {p.began}-{p.recorded_to}: {p.path} "
                         f"(TensorBoard's profile plugin, chrome://tracing or ui.perfetto.dev)")
