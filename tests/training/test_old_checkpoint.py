"""A checkpoint written by brickyard 0.2.0 (tests/fixtures/run-0.2.0: step 8 of 16 of a small run with EMA and
early stopping, fp32, one thread, written on an AVX2-only CPU) resumes under today's code and ends with the weights of
an uninterrupted run of today's code, bit for bit. Both runs use the AVX2 kernels that wrote it (ATen's and oneDNN's,
pinned below): on an AVX-512 CPU torch's own kernels round differently, and the two runs would differ by about 6e-8."""
import hashlib
import shutil
from pathlib import Path

import torch

from conftest import run_cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-0.2.0"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def weights_hash(run_dir: Path, step: int) -> str:
    state = torch.load(run_dir / "checkpoints" / f"step-{step:07d}.pt", weights_only=True)
    return hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(state["model"].items()))).hexdigest()


def test_a_checkpoint_of_0_2_0_resumes_and_ends_as_an_uninterrupted_run(tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(FIXTURE, resumed)
    r = run_cli("train", str(resumed / "config.yaml"), "--run-dir", str(resumed), "--resume", "auto", env=AVX2)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in (resumed / "train.log").read_text()
    fresh = tmp_path / "fresh"
    r = run_cli("train", str(FIXTURE / "config.yaml"), "--run-dir", str(fresh), env=AVX2)
    assert r.returncode == 0, r.stderr
    assert weights_hash(resumed, 16) == weights_hash(fresh, 16)
