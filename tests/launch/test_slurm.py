"""brickyard under a real Slurm: one node, Debian's slurmctld + slurmd + munge started for this module
(``tests/slurm_cluster.py``), jobs submitted with srun and sbatch, cancelled with scancel.

Pinned: fp32, one thread per process, the same global batch on 1 and 2 processes, dist.timeout_s small
where a test waits for a timeout. Skipped, with the reason, where Slurm is not installed or not root.
"""
import json
import os
import re
import shlex
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

import slurm_cluster
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, ONE_BAD_IMAGE, ROOT, SYNTH, one_bad_image, readers_of_the_bad_image, run_cli, sets

pytestmark = pytest.mark.skipif(slurm_cluster.unavailable() is not None, reason=str(slurm_cluster.unavailable()))

SAME = SYNTH + ["train.deterministic=true", "train.max_steps=12", "train.epochs=10", "optim.name=momentum",
                "data.global_batch_size=64", "train.log_every=4", "train.plots=false"]
BRICKYARD = [sys.executable, "-m", "brickyard"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def cluster(slurm):
    yield slurm
    slurm.wait_idle()


def _final(run):
    return checkpoint.load(checkpoint.step_checkpoints(run / "checkpoints")[-1])


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_srun_two_tasks_train_as_one_process_would_in_one_run_directory(cluster, tmp_path):
    one = tmp_path / "one"
    r = run_cli("train", *sets(*SAME), "--run-dir", str(one))
    assert r.returncode == 0, r.stderr
    r = cluster.run(["srun", "-n", "2", *BRICKYARD, "train", *sets(*SAME)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    made = [p for p in (tmp_path / "runs").iterdir()]
    assert len(made) == 1 and re.fullmatch(r"mnist-slurm\d+\.0", made[0].name), made  # one folder, from the job and step
    run = made[0]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["workerlog.0", "workerlog.1"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert _diff(_final(one)["model"], _final(run)["model"]) < ACROSS_ORDERS
    assert r.stdout.count("test accuracy:") == 1  # rank 0 alone prints the result


def test_a_bad_image_only_rank_1_reads_is_what_srun_prints(cluster, tmp_path):
    """Under srun rank 0 prints the job's error. Rank 1 met the cut image alone, and rank 0 only lost it: the
    one line is rank 1's sentence (left in the job's store), with rank 1's exit code, not "a collective lost
    a peer"."""
    data, run = one_bad_image(tmp_path / "data"), tmp_path / "run"
    r = cluster.run(["srun", "-n", "2", *BRICKYARD, "train", *sets(*ONE_BAD_IMAGE, f"data.root={data}"),
                     "--run-dir", str(run)], timeout=200)
    assert readers_of_the_bad_image(run / "logs") == [1]  # seed 1 gives it to rank 1
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: ") and "039.jpg is unreadable or truncated" in errors[0], r.stderr
    assert r.returncode == 2 and "collective" not in r.stderr, r.stderr[-3000:]


LONG = [s for s in SAME if not s.startswith(("train.max_steps", "train.epochs"))] + [
    "train.epochs=2000", "checkpoint.every_steps=50", "train.log_every=10"]


def test_scancel_saves_a_checkpoint_and_the_run_resumes_under_srun(cluster, tmp_path):
    run = tmp_path / "run"
    job = cluster.run(["sbatch", "--parsable", "-n", "2", "-o", str(tmp_path / "job.out"), "--wrap",
                       shlex.join(["srun", *BRICKYARD, "train", *sets(*LONG), "--run-dir", str(run)])], cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    deadline = time.time() + 120
    while not any(json.loads(l).get("kind") == "train" and json.loads(l)["step"] >= 60
                  for l in ((run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else [])):
        assert time.time() < deadline, (tmp_path / "job.out").read_text()[-3000:] if (tmp_path / "job.out").exists() else "no output"
        time.sleep(0.2)
    cluster.run(["scancel", job_id])  # SIGTERM to every task, SIGKILL after KillWait
    cluster.wait_idle()
    out = (tmp_path / "job.out").read_text()
    saved = checkpoint.step_checkpoints(run / "checkpoints")
    assert saved, out[-3000:]
    stopped_at = checkpoint.load(saved[-1])["step"]
    assert "SIGTERM at step" in out and f"resume with `brickyard train --run-dir {run} --resume auto`" in out, out[-3000:]
    r = cluster.run(["srun", "-n", "2", *BRICKYARD, "train", "--run-dir", str(run), "--resume", "auto",
                     "--set", f"train.max_steps={stopped_at + 20}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {saved[-1]} at step {stopped_at}" in (run / "logs" / "workerlog.1").read_text()
    assert json.loads((run / "summary.json").read_text())["steps"] == stopped_at + 20


def _silent_listener():
    """A program holding a port that accepts connections and never answers."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(100)], daemon=True).start()
    return srv


def test_a_rendezvous_port_in_use_is_one_sentence_on_every_rank_within_seconds(cluster, tmp_path):
    srv = _silent_listener()
    port = srv.getsockname()[1]
    start = time.time()
    r = cluster.run(["srun", "-n", "2", *BRICKYARD, "train", *sets(*SAME, "dist.timeout_s=120"), "--run-dir", str(tmp_path / "r")],
                    env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout=200)
    took = time.time() - start
    srv.close()
    assert r.returncode != 0 and took < 60, (took, r.stderr[-2000:])
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 2, r.stderr[-3000:]
    assert any(f"rank 0: port {port} on 127.0.0.1 is in use by another program" in l for l in errors), errors
    assert any(f"rank 1: the program listening at 127.0.0.1:{port} does not answer as rank 0's rendezvous" in l for l in errors), errors
    assert "Traceback" not in r.stderr and "[c10d]" not in r.stderr


def test_a_rank_that_cannot_reach_rank_0_names_the_address_it_waited_for(cluster, tmp_path):
    """Rank 0 fails before the rendezvous (here: exits at once); rank 1 says so within dist.timeout_s."""
    train = shlex.join([*BRICKYARD, "train", *sets(*SAME, "dist.timeout_s=8"), "--run-dir", str(tmp_path / "r")])
    start = time.time()
    r = cluster.run(["srun", "-n", "2", "bash", "-c", f'[ "$SLURM_PROCID" = 0 ] && exit 3; exec {train}'], timeout=200)
    took = time.time() - start
    assert r.returncode != 0 and took < 40, (took, r.stderr[-2000:])
    m = re.search(r"error: rank 1: nothing answered at (\S+):(\d+) within dist.timeout_s=8s", r.stderr)
    assert m, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "[c10d]" not in r.stderr and "C++" not in r.stderr


def test_brickyard_in_a_batch_script_without_srun_says_to_use_srun_or_devices(cluster, tmp_path):
    out = tmp_path / "job.out"
    train = shlex.join([*BRICKYARD, "train", *sets(*SAME), "--run-dir", str(tmp_path / "r")])
    start = time.time()
    job = cluster.run(["sbatch", "--wait", "-n", "2", "-o", str(out), "--wrap", train], cwd=tmp_path, timeout=200)
    assert job.returncode != 0 and time.time() - start < 60
    text = out.read_text()
    assert "error: this is the batch script of a Slurm allocation of 2 tasks, but brickyard was not started by srun" in text, text
    assert not (tmp_path / "r").exists()
    # asked for one process (--devices cpu), it runs as one
    job = cluster.run(["sbatch", "--wait", "-n", "2", "-o", str(out), "--wrap", train + " --devices cpu"], cwd=tmp_path, timeout=300)
    assert job.returncode == 0, out.read_text()[-3000:]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["world_size"] == 1


def _scripts() -> str:
    """The folder of the `brickyard` command installed beside this Python (a venv's bin, wherever it is)."""
    here = Path(sys.executable).parent
    found = shutil.which("brickyard", path=f"{here}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "no `brickyard` command beside this Python or on PATH: pip install -e . first"
    return str(Path(found).parent)


def test_the_readme_sbatch_script_works_as_written(cluster, tmp_path):
    readme = (ROOT / "README.md").read_text()
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", readme, re.S).group(1)
    # the README's script, with this test's short settings in place of the full run
    script = script.replace("brickyard train mnist", "brickyard train mnist " + " ".join(sets(*SAME)))
    (tmp_path / "job.sh").write_text(script)
    job = cluster.run(["sbatch", "--wait", "-o", str(tmp_path / "job.out"), str(tmp_path / "job.sh")], cwd=tmp_path,
                      timeout=300, env={"PATH": f"{_scripts()}:{cluster.env['PATH']}"})
    out = (tmp_path / "job.out").read_text()
    assert job.returncode == 0, out[-3000:]
    run = next((tmp_path / "runs").iterdir())
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2, out[-3000:]
