"""A checkpoint written by brickyard 0.2.0 (tests/fixtures/run-0.2.0: step 8 of 16 of a small run with EMA and
early stopping, fp32, one thread) resumes under today's code and ends with the weights of an uninterrupted run of
today's code on the same machine."""
import hashlib
import shutil
from pathlib import Path

import torch

from conftest import run_cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-0.2.0"


def weights_hash(run_dir: Path, step: int) -> str:
    state = torch.load(run_dir / "checkpoints" / f"step-{step:07d}.pt", weights_only=True)
    return hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(state["model"].items()))).hexdigest()


def test_a_checkpoint_of_0_2_0_resumes_and_ends_as_an_uninterrupted_run(tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(FIXTURE, resumed)
    r = run_cli("train", str(resumed / "config.yaml"), "--run-dir", str(resumed), "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in (resumed / "train.log").read_text()
    fresh = tmp_path / "fresh"
    r = run_cli("train", str(FIXTURE / "config.yaml"), "--run-dir", str(fresh))
    assert r.returncode == 0, r.stderr
    assert weights_hash(resumed, 16) == weights_hash(fresh, 16)
