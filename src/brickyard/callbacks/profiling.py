"""``Profiling``: ``train.profile_steps: [a, b]`` records steps a to b - 1 with ``torch.profiler``
(``brickyard.observe.profiling``) into ``RUN_DIR/profile`` (or ``train.profile_dir``), on every rank."""
from __future__ import annotations

from brickyard.callbacks.base import Callback
from brickyard.observe.profiling import StepProfiler


class Profiling(Callback):
    def __init__(self, first: int, last: int, out_dir, rank: int, device):
        self.profiler = StepProfiler(first, last, out_dir, rank, device)

    def on_step_start(self, run):
        self.profiler.step_start(run.step)

    def on_step_end(self, run, loss):
        self.profiler.step_end(run.step)
        if self.profiler.path is not None and not getattr(self, "_said", False):
            self._said = True
            run.log.info(f"profile of steps {self.profiler.first}-{self.profiler.last - 1}: {self.profiler.path} "
                         f"(TensorBoard's profile plugin, chrome://tracing or ui.perfetto.dev)")

    def on_loop_end(self, run):
        self.profiler.close()
