"""What a run directory guarantees, tried as a hostile but ordinary world would: a second process, a
size limit, a full disk, a SIGKILL in the middle of a checkpoint, planted links, a flipped byte, a second user.
Every test runs real brickyard processes on synthetic data (fp32, one thread, one process)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from brickyard.training import checkpoint
from brickyard.training.rundir import repair_metrics
from conftest import SYNTH, have_mnist, run_cli, run_cli_many, sets


def files_of(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def unchanged_but_logs(before: dict) -> None:
    for p, content in before.items():
        if p.name in ("train.log", "workerlog.0"):  # logs only grow
            assert p.read_bytes().startswith(content), p
        else:
            assert p.read_bytes() == content, p


def train_rows(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def test_a_second_process_on_a_live_run_directory_is_refused_naming_the_first(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "brickyard", "train", *sets(*SYNTH, "train.epochs=400", "train.log_every=5"),
                              "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").is_file() and "train" in (run / "metrics.jsonl").read_text()):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        for extra in (["--resume", "auto"], []):
            r = run_cli("train", *sets(*SYNTH, "train.epochs=400"), "--run-dir", str(run), *extra)
            assert r.returncode == 2, r.stderr
            assert r.stderr.startswith(f"error: run directory {run} is in use by process {first.pid} on this machine ("), r.stderr
            assert len(r.stderr.strip().splitlines()) == 1
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    steps = train_rows(run)
    assert steps == sorted(set(steps))  # one run's rows only, in order
    # once it has ended, the directory is free: the run continues
    r = run_cli("train", *sets(*SYNTH, "train.epochs=400", "train.max_steps=" + str(steps[-1] + 10)), "--run-dir", str(run),
                "--resume", "auto")
    assert r.returncode == 0, r.stderr


def test_resume_file_into_a_directory_of_another_run_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for r in run_cli_many(*[["train", *sets(*SYNTH, "train.epochs=2", "checkpoint.keep_last=3"), "--run-dir", run] for run in (a, b)]):
        assert r.returncode == 0, r.stderr
    before = files_of(a)
    other = checkpoint.step_checkpoints(b / "checkpoints")[0]
    r = run_cli("train", *sets(*SYNTH, "train.epochs=3"), "--run-dir", str(a), "--resume", str(other))
    assert r.returncode == 2 and f"run directory {a} holds another run, whose checkpoints this run would rotate away" in r.stderr
    unchanged_but_logs(before)
    # a file of the run's own may be resumed from; into a new directory any file may
    own = checkpoint.step_checkpoints(a / "checkpoints")[0]
    assert run_cli("train", *sets(*SYNTH, "train.epochs=3"), "--run-dir", str(a), "--resume", str(own)).returncode == 0
    assert run_cli("train", *sets(*SYNTH, "train.epochs=3"), "--run-dir", str(tmp_path / "c"), "--resume", str(other)).returncode == 0


def test_resume_file_compares_the_config_as_resume_auto_does(tmp_path):
    run = tmp_path / "run"
    assert run_cli("train", *sets(*SYNTH, "train.epochs=1"), "--run-dir", str(run)).returncode == 0
    path = checkpoint.step_checkpoints(run / "checkpoints")[-1]
    changes = (("optim.name=adam", "optim.name"), ("data.batch_size=64", "data.batch_size"))
    *refused, ok = run_cli_many(*[["train", *sets(*SYNTH, "train.epochs=2", change), "--run-dir", tmp_path / key, "--resume", path]
                                  for change, key in changes],
                                # what may change on resume still may
                                ["train", *sets(*SYNTH, "train.epochs=2", "train.log_every=3"), "--run-dir", tmp_path / "ok",
                                 "--resume", path])
    for (_, key), r in zip(changes, refused):
        assert r.returncode == 2 and r.stderr.startswith(f"error: --resume: {key} is "), r.stderr
        assert f"in the checkpoint {path}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert ok.returncode == 0, ok.stderr


def test_a_users_config_in_the_run_directory_is_never_replaced(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    mine = "# my experiment: the course's optimiser\nbase: mnist\noptim:\n  name: nesterov  # as in the lecture\n"
    (exp / "config.yaml").write_text(mine)
    r = run_cli("train", "config.yaml", *sets(*SYNTH), "--run-dir", ".", cwd=exp)
    assert r.returncode == 2 and "holds a config.yaml that brickyard did not write" in r.stderr, r.stderr
    assert (exp / "config.yaml").read_text() == mine
    assert sorted(p.name for p in exp.iterdir()) == ["config.yaml"]  # a refused start leaves no lock file in a folder of the user's
    # a run directory beside it is fine, and its config.yaml says what wrote it
    r = run_cli("train", "config.yaml", *sets(*SYNTH, "train.epochs=1"), "--run-dir", "runs/a", cwd=exp)
    assert r.returncode == 0, r.stderr
    assert (exp / "runs/a/config.yaml").read_text().startswith("# the resolved config of this run, written by brickyard")


def test_a_file_size_limit_during_resume_leaves_a_run_that_resumes(tmp_path):
    run = tmp_path / "run"
    assert run_cli("train", *sets(*SYNTH, "train.epochs=1"), "--run-dir", str(run)).returncode == 0
    config = (run / "config.yaml").read_bytes()
    assert len(config) > 2048  # the limit below cuts it
    cmd = [sys.executable, "-m", "brickyard", "train", *sets(*SYNTH, "train.epochs=3"), "--run-dir", str(run), "--resume", "auto"]
    r = subprocess.run(["bash", "-c", 'ulimit -f 2; exec "$@"', "bash", *cmd], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stderr.startswith("error: "), r.stderr
    assert (run / "config.yaml").read_bytes() == config  # whole, as before
    assert not [p for p in run.rglob("*.tmp")]  # the failed write took its temporary with it
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "epochs: 3" in (run / "config.yaml").read_text()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one checkpoint of the synthetic runs' MLP (2.2 MB with its momentum), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_full_disk_is_one_line_and_the_run_resumes_once_there_is_room(small_disk):
    """torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected pos", a crash
    report before: the system's own reason is said, naming the checkpoint, and nothing already written breaks."""
    run = small_disk / "run"
    args = ["train", *sets(*SYNTH, "train.epochs=3", "checkpoint.every_steps=20", "checkpoint.every_epoch=false",
                           "checkpoint.keep_last=3", "train.plots=false"), "--run-dir", str(run)]
    r = run_cli(*args)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {run}/checkpoints/step-0000040.pt: No space left on device.", \
        r.stderr[-2000:]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-0000020.pt"]  # whole; no temporary left
    assert checkpoint.load(run / "checkpoints" / "step-0000020.pt")["step"] == 20
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    r = run_cli(*args, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in (run / "train.log").read_text() and json.loads((run / "summary.json").read_text())["steps"] == 48
    assert train_rows(run) == sorted(set(train_rows(run)))  # the rows past step 20 were dropped, then written once


KILL_MID_SAVE = r"""
import os, signal, sys, torch
from brickyard import api
from brickyard.config import load_config
real = torch.save
def save(obj, f, *a, **k):  # the third checkpoint: half of it reaches the disk, then the process dies
    if isinstance(obj, dict) and obj.get("step") == int(sys.argv[2]):
        f.write(b"PK\x03\x04" + os.urandom(5000)); f.flush(); os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *a, **k)
torch.save = save
api.train_config(load_config("mnist", sys.argv[3:]), sys.argv[1])
"""


def test_sigkill_during_a_checkpoint_write_resumes_from_the_last_good_one(tmp_path):
    run = tmp_path / "run"
    over = [*SYNTH, "train.epochs=3", "checkpoint.every_steps=4", "train.log_every=2", "checkpoint.keep_last=5"]
    r = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, str(run), "12", *over], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert [p.name for p in checkpoint.step_checkpoints(run / "checkpoints")] == [
        "step-0000004.pt", "step-0000008.pt"]  # the one being written never appeared under its name
    stale = [p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].startswith(".step-0000012.pt.")
    assert max(train_rows(run)) > 8  # rows past the checkpoint it will resume from
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 1')  # and a line cut by the crash
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (run / "checkpoints" / ".step-0000099.pt.abcdefgh.tmp").symlink_to(victim)  # a link shaped like a temporary
    (run / "notes.abcdefgh.tmp").write_text("the user's")  # a file of the user's shaped like one
    r = run_cli("train", *sets(*over), "--run-dir", str(run), "--resume", "auto")
    assert r.returncode == 0, r.stderr
    log = (run / "train.log").read_text()
    assert "resumed from" in log and "step-0000008.pt at step 8" in log
    assert "removed 1 temporary file(s) of interrupted writes" in log
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".step-0000012")]
    assert victim.read_text() == "keep me" and (run / "checkpoints" / ".step-0000099.pt.abcdefgh.tmp").is_symlink()
    assert (run / "notes.abcdefgh.tmp").read_text() == "the user's"
    steps = train_rows(run)
    assert steps == sorted(set(steps)) and steps[-1] == 48  # no step twice, none lost
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert all(isinstance(json.loads(x), dict) for x in rows)


@pytest.mark.fast
def test_repair_metrics_keeps_what_came_before_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "start", "step": 0}\n{"kind": "train", "step": 5}\n[1]\n{"kind": "train", "step": 10}\n'
                    '{"kind": "val", "step": 10}\n{"kind": "train", "st')
    assert repair_metrics(path, 5) == 4
    assert path.read_text() == '{"kind": "start", "step": 0}\n{"kind": "train", "step": 5}\n'
    assert repair_metrics(path, 5) == 0
    path.write_text('{"kind": "train", "step": 5}')  # whole, but no newline: the next row would be glued on
    repair_metrics(path, 5)
    assert path.read_text() == '{"kind": "train", "step": 5}\n'


def test_links_planted_at_temporary_names_are_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    run, out = tmp_path / "run", tmp_path / "out"
    (run / "checkpoints").mkdir(parents=True)
    out.mkdir()
    # the fixed temporary names brickyard's writers used, and a name in mkstemp's shape
    for name in ("checkpoints/.best.pt.tmp", ".summary.json.tmp", ".env.json.tmp", ".config.yaml.tmp", ".curves.png.tmp",
                 "checkpoints/.step-0000016.pt.tmp", "checkpoints/.best.pt.aaaaaaaa.tmp"):
        (run / name).symlink_to(victim)
    for name in (".tmp-m.pt2", ".m.safetensors.tmp", ".m.torchscript.pt.tmp", ".m.pt2.tmp"):
        (out / name).symlink_to(victim)
    commands = [["train", *sets(*SYNTH, "train.epochs=1", "train.plots=true"), "--run-dir", run]]
    commands += [["export", run, "--format", fmt, "--out", out / name]
                 for fmt, name in (("safetensors", "m.safetensors"), ("torchscript", "m.torchscript.pt"), ("torch-export", "m.pt2"))]
    # the image writers: a photo-like folder, and MNIST exported as image files
    photos = tmp_path / "photos"
    (photos / "train" / "00-disc").mkdir(parents=True)
    (photos / "train" / "00-disc" / ".00000.jpg.tmp").symlink_to(victim)
    commands.append(["data", "make-photos", photos, "--classes", "2", "--per-class", "1", "1", "1", "--max-size", "64"])
    images = tmp_path / "images"
    if have_mnist():
        (images / "train" / "0").mkdir(parents=True)
        (images / "train" / "0" / ".00001.png.tmp").symlink_to(victim)
        commands.append(["data", "export", "mnist", images, "--limit", "2"])
    for c, r in zip(commands, run_cli_many(*commands)):  # one process: what is checked is what each writer writes
        assert r.returncode == 0, (c[:2], r.stderr)
    if have_mnist():
        assert len(list((images / "train" / "0").glob("*.png"))) == 2
    assert victim.read_text() == "keep me"
    assert (run / "checkpoints" / "best.pt").is_file() and (run / "summary.json").is_file()
    assert (photos / "train" / "00-disc" / "00000.jpg").is_file()


def test_a_flipped_byte_is_named_and_resume_falls_back(tmp_path):
    run = tmp_path / "run"
    assert run_cli("train", *sets(*SYNTH, "train.epochs=2", "checkpoint.keep_last=2"), "--run-dir", str(run)).returncode == 0
    older, newest = checkpoint.step_checkpoints(run / "checkpoints")
    state = torch.load(newest, weights_only=True)
    raw = bytearray(newest.read_bytes())
    weights = max(state["model"].values(), key=lambda t: t.numel()).numpy().tobytes()
    at = bytes(raw).index(weights[:64]) + 1000  # inside a tensor's data: torch.load alone would not notice
    raw[at] ^= 0x10
    newest.write_bytes(bytes(raw))
    image = tmp_path / "x.png"
    Image.new("L", (28, 28)).save(image)
    for cmd in (["eval", str(newest)], ["predict", str(newest), str(image)],
                ["export", str(newest), "--out", str(tmp_path / "m.safetensors")]):
        r = run_cli(*cmd)
        assert r.returncode == 2 and r.stderr.startswith(f"error: checkpoint {newest} is damaged: "), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("train", *sets(*SYNTH, "train.epochs=3", "checkpoint.keep_last=2"), "--run-dir", str(run), "--resume", "auto")
    assert r.returncode == 0, r.stderr
    log = (run / "train.log").read_text()
    assert f"checkpoint {newest} is damaged" in log and f"resumed from {older}" in log


NOBODY = 65534


def _as_nobody(code: str, env: dict) -> subprocess.CompletedProcess:
    """``code`` in a process that becomes user ``nobody`` once Python and brickyard are imported (the
    interpreter may live where that user cannot read, e.g. under /root)."""
    become = f"import numpy, gzip, hashlib, os, brickyard.data.idx\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
    return subprocess.run([sys.executable, "-c", become + code], capture_output=True, text=True, timeout=300, env=env,
                          cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second user id")
def test_a_shared_cache_serves_a_second_user_and_is_never_deleted_for_permissions():
    from brickyard.data import idx
    source = idx.locate("mnist", None)
    if source is None:
        pytest.skip("MNIST files not found (set BRICKYARD_DATA)")
    shared = Path(tempfile.mkdtemp(prefix="brickyard-shared-", dir="/tmp"))
    try:
        os.chmod(shared, 0o777)  # a shared data folder: everyone may read and add caches
        (shared / "mnist").mkdir(mode=0o777)
        os.chmod(shared / "mnist", 0o777)
        for p in source.iterdir():
            if p.name.startswith(("train-", "t10k-")):
                shutil.copyfile(p, shared / "mnist" / p.name)
                os.chmod(shared / "mnist" / p.name, 0o644)
        old = os.umask(0o022)
        try:
            subprocess.run([sys.executable, "-c", "from brickyard.data import idx; idx.load_idx('mnist', None, False)"],
                           env={**os.environ, "BRICKYARD_DATA": str(shared)}, check=True, timeout=300)
        finally:
            os.umask(old)
        caches = sorted((shared / "mnist").glob(".*.npy"))
        assert len(caches) == 4 and all(c.stat().st_mode & 0o777 == 0o644 for c in caches)  # the umask's, not mkstemp's 0600
        env = {**os.environ, "BRICKYARD_DATA": str(shared), "BRICKYARD_CACHE": str(shared / "nobody-cache")}
        code = ("from brickyard.data import idx; d = idx.load_idx('mnist', None, False); "
                "print(type(d['train-images-idx3-ubyte']).__name__, d['train-labels-idx1-ubyte'][:5].tolist())")
        r = _as_nobody(code, env)
        assert r.returncode == 0 and r.stdout.strip() == "memmap [5, 0, 4, 1, 9]", r.stderr  # read from the root's cache
        for c in caches:
            os.chmod(c, 0o600)  # another user's private cache in the shared folder
        r = _as_nobody(code, env)
        assert r.returncode == 0 and r.stdout.strip() == "ndarray [5, 0, 4, 1, 9]", r.stderr  # decoded from the source
        assert sorted((shared / "mnist").glob(".*.npy")) == caches  # and the unreadable caches kept
        for p in (shared / "mnist").glob("train-labels-idx1-ubyte*"):
            os.chmod(p, 0o600)  # and a source file this user may not read
        r = _as_nobody("from brickyard.data import idx\ntry:\n    idx.load_idx('mnist', None, False)\n"
                       "except Exception as e:\n    print(e)", env)
        assert "cannot be read: permission denied" in r.stdout, r.stdout + r.stderr
    finally:
        shutil.rmtree(shared)


@pytest.mark.fast
def test_a_line_that_is_not_a_row_is_said_as_such_not_as_a_row_past_the_step(tmp_path):
    from brickyard.training.rundir import RunDir
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "start", "step": 0}\n{"kind": "train", "step": 5}\nnot json\n{"kind": "val", "step": 8}\n'
                    '{"kind": "train", "step": 20}\n')
    said = RunDir(tmp_path, True).repair(16)
    assert said == ["dropped 1 metrics.jsonl row(s) past step 16 (they are trained again)",
                    "dropped 1 metrics.jsonl line(s) that were not JSON rows (line 3: cut by a crash or written by "
                    "something else)"]
    assert path.read_text() == '{"kind": "start", "step": 0}\n{"kind": "train", "step": 5}\n{"kind": "val", "step": 8}\n'


@pytest.mark.fast
def test_a_refused_start_in_a_users_folder_leaves_no_lock_file(tmp_path):
    from brickyard.errors import BrickyardError
    from brickyard.training.rundir import LOCK, RunDir
    (tmp_path / "config.yaml").write_text("my: own\n")
    with pytest.raises(BrickyardError, match="holds a config.yaml that brickyard did not write"):
        RunDir(tmp_path, True).lock(None, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    (tmp_path / LOCK).write_text("")  # a lock file that was there before stays
    with pytest.raises(BrickyardError):
        RunDir(tmp_path, True).lock(None, False)
    assert (tmp_path / LOCK).exists()
