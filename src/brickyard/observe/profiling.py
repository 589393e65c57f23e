"""``torch.profiler`` traces of chosen steps, for TensorBoard's profile plugin and Chrome's trace viewer.

``StepProfiler(first, last, out_dir, rank)`` records steps ``first`` to ``last - 1`` (CPU operators, and
CUDA kernels on a GPU run) and writes ``out_dir/rank<R>.<pid>.pt.trace.json`` when the last one ends:
the file name TensorBoard's ``torch-tb-profiler`` plugin looks for under its ``--logdir``, in the
Chrome trace format that ``chrome://tracing`` and https://ui.perfetto.dev open. Each step is marked
(``ProfilerStep#N``). A run that starts inside the range (resumed there) records from its first step;
``began`` and ``recorded_to`` say which steps a trace holds. Used by ``train.profile_steps`` (a callback)
and ``brickyard bench --profile DIR``.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, first: int, last: int, out_dir: Path, rank: int = 0, device: torch.device | None = None):
        self.first, self.last, self.out_dir, self.rank = int(first), int(last), Path(out_dir), rank
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device is not None and device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = None
        self.path: Path | None = None
        self.began: int | None = None        # the first step recorded
        self.recorded_to: int | None = None  # the last step recorded so far

    def step_start(self, step: int) -> None:
        if self.first <= step < self.last and self.prof is None and self.began is None:
            self.began = step
            plan = self._plan  # a schedule, so that each step is marked ProfilerStep#<the run's step>
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no warm-up steps": the steps asked for are the ones recorded
                self.prof = torch.profiler.profile(activities=self.activities, schedule=plan, record_shapes=True,
                                                   on_trace_ready=self._write)
                self.prof.step_num = step
                self.prof.start()

    def _plan(self, step: int):
        """Record every step up to ``last - 1`` (the profiler asks at step 0 too, before it is moved to
        ``first``), save at ``last - 1``."""
        A = torch.profiler.ProfilerAction
        return A.NONE if step >= self.last else A.RECORD_AND_SAVE if step == self.last - 1 else A.RECORD

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{self.rank}.{os.getpid()}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.path = path

    def step_end(self, step: int) -> None:
        if self.prof is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.prof.step()  # after the last recorded step this writes the trace (``_write``)
        self.recorded_to = step
        if step + 1 >= self.last:
            self.close()

    def close(self) -> None:
        """Stop (a run that ends before ``last`` writes what it recorded)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.stop()
        if self.path is None and prof.profiler is not None:
            self._write(prof)
