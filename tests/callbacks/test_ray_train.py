"""``brickyard.fit`` inside Ray Train's ``TorchTrainer``: a real local Ray cluster of two workers (``ray_job.py``, in
a process of its own), its reports and checkpoints, a restart after a failure that continues exactly; and, without
Ray's servers, which checkpoint ``ray_resume`` picks and the sentence outside a Ray worker."""
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brickyard.callbacks import RayReport, ray_train
from brickyard.errors import BrickyardError
from conftest import needs_mnist

HERE = Path(__file__).parent
HAVE_RAY = importlib.util.find_spec("ray") is not None


@needs_mnist
@pytest.mark.skipif(not HAVE_RAY, reason="Ray Train is not installed (pip install 'brickyard[ray]')")
def test_ray_train_reports_each_epoch_and_restarts_exactly(tmp_path):
    # pinned in ray_job.py: fp32, 1 thread a worker, 2 workers, MNIST 2,000 images, 3 epochs of 20 steps
    job = subprocess.Popen([sys.executable, str(HERE / "ray_job.py"), str(tmp_path)], cwd=tmp_path, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONPATH": str(HERE.parent)})
    try:
        out, _ = job.communicate(timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # Ray's servers, where the job did not stop them
    assert job.returncode == 0, out[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (tmp_path / "failed-rank0").exists() and (tmp_path / "failed-rank1").exists(), "the failure was not injected"
    # every epoch's end reported once, with its validation and the checkpoint of that step, across the restart
    steps = [m["step"] for _, m in result["reports"]]
    assert steps == [20, 40, 60], steps
    assert all(m["validated_at"] == m["step"] for _, m in result["reports"])
    accuracy = [m["val_accuracy"] for _, m in result["reports"]]
    assert accuracy[-1] > 0.85 and accuracy[-1] >= accuracy[0], accuracy
    held = torch.load(Path(result["checkpoint"]) / "checkpoint.pt", weights_only=False)
    assert held["step"] == 60 and result["metrics"]["step"] == 60
    # the restarted workers continued the run in its directory from the step Ray held, and ended where an
    # uninterrupted brickyard.launch of the same recipe ends, bit for bit
    assert (tmp_path / "ray-resumed-from.txt").read_text() == str(tmp_path / "ray-run/checkpoints/step-0000040.pt")
    ray_w, ref_w = torch.load(tmp_path / "ray-weights.pt"), torch.load(tmp_path / "reference-weights.pt")
    assert all(torch.equal(ray_w[k], ref_w[k]) for k in ref_w)
    rows = [json.loads(line) for line in (tmp_path / "ray-run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "val"] == [20, 40, 60]


class _Checkpoint:
    def __init__(self, path: Path):
        self.path = str(path)

    @contextlib.contextmanager
    def as_directory(self):
        yield self.path


class _Train:
    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def get_checkpoint(self):
        return self.checkpoint


def _resume(monkeypatch, checkpoint, run_dir):
    monkeypatch.setattr(ray_train, "_ray_train", lambda: _Train(checkpoint))
    with ray_train.ray_resume(run_dir) as resume:
        return resume


@pytest.mark.fast
def test_ray_resume_picks_the_runs_own_file_else_rays_copy(tmp_path, monkeypatch):
    ray_ckpt = tmp_path / "storage/step-0000040"
    ray_ckpt.mkdir(parents=True)
    (ray_ckpt / "checkpoint.pt").write_bytes(b"state at 40")
    run = tmp_path / "run"
    assert _resume(monkeypatch, None, run) is None  # a first start
    assert _resume(monkeypatch, _Checkpoint(ray_ckpt), run) == str(ray_ckpt / "checkpoint.pt")  # a new machine
    (run / "checkpoints").mkdir(parents=True)
    own = run / "checkpoints/step-0000040.pt"
    own.write_bytes(b"state at 41")  # a file of that name, not the one Ray holds
    assert _resume(monkeypatch, _Checkpoint(ray_ckpt), run) == str(ray_ckpt / "checkpoint.pt")
    own.write_bytes(b"state at 40")
    assert _resume(monkeypatch, _Checkpoint(ray_ckpt), run) == str(own)
    assert _resume(monkeypatch, _Checkpoint(ray_ckpt), None) == str(ray_ckpt / "checkpoint.pt")
    (ray_ckpt / "checkpoint.pt").unlink()
    with pytest.raises(BrickyardError, match=r"^the Ray checkpoint .* holds no checkpoint.pt: it was not reported by RayReport\.$"):
        _resume(monkeypatch, _Checkpoint(ray_ckpt), run)


@pytest.mark.fast
def test_ray_report_outside_a_ray_worker_is_one_sentence():
    said = "inside a Ray Train training function" if HAVE_RAY else r"need Ray Train: pip install 'brickyard\[ray\]'"
    with pytest.raises(BrickyardError, match=said):
        RayReport()
