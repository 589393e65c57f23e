"""Loggers in real runs: a user's logger passed to ``fit`` and one a tiny installed package adds through the
``brickyard.loggers`` entry point get exactly the rows of metrics.jsonl; a tracking server that accepts connections
and never answers, and a logger that stalls mid-run, are dropped with one warning within seconds, and SIGTERM
during either is heeded. fp32, one thread."""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import SYNTH, run_cli, sets

RUN = SYNTH + ["train.max_steps=12", "train.log_every=4", "train.epochs=2", "train.plots=false"]
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="mlflow not installed (pip install 'brickyard[mlflow]')")

PACKAGE = '''
import json, os, threading
from brickyard.observe.loggers import Logger

class Rows(Logger):
    """Every row, as metrics.jsonl writes it, into RUN_DIR/rows.jsonl."""
    def start(self, run):
        self.f = open(os.path.join(run.run_dir, "rows.jsonl"), "a", buffering=1)
    def log(self, row):
        self.f.write(json.dumps(row) + "\\n")
    def finish(self, ok):
        self.f.write(json.dumps({"finished": ok}) + "\\n")
        self.f.close()

class Hangs(Logger):
    """A tracker whose server stops answering at the first validation (or, with HANG_AT=train, at once)."""
    timeout_s = 1.0
    def log(self, row):
        if row["kind"] == os.environ.get("HANG_AT", "val"):
            threading.Event().wait()
'''


def package(tmp_path):
    """A package installed on PYTHONPATH as pip would leave it: the module and its dist-info with the entry points."""
    root = tmp_path / "site"
    (root / "rowlog-0.1.dist-info").mkdir(parents=True)
    (root / "rowlog.py").write_text(PACKAGE)
    (root / "rowlog-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: rowlog\nVersion: 0.1\n")
    (root / "rowlog-0.1.dist-info" / "entry_points.txt").write_text(
        "[brickyard.loggers]\nrows = rowlog:Rows\nhangs = rowlog:Hangs\n")
    return {"PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def warnings_in(stderr):
    return [line for line in stderr.splitlines() if line.startswith("warning: train.loggers:")]


def test_a_logger_from_an_installed_package_gets_the_rows_of_metrics_jsonl(tmp_path):
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[rows, csv]"), "--run-dir", str(run), env=package(tmp_path))
    assert r.returncode == 0, r.stderr
    got = rows(run / "rows.jsonl")
    assert got[:-1] == rows(run / "metrics.jsonl") and got[-1] == {"finished": True}
    assert [x["kind"] for x in got[:-1]].count("train") == 3 and got[-2]["kind"] == "summary"
    vals = [x["step"] for x in got[:-1] if x["kind"] == "val"]
    assert vals and [int(line.split(",")[0]) for line in (run / "metrics.csv").read_text().splitlines()[1:]] == vals


def test_a_logger_passed_to_fit_gets_the_rows_of_metrics_jsonl(tmp_path):
    import torch

    import brickyard
    from brickyard.observe.loggers import Logger

    class Mine(Logger):
        def __init__(self):
            self.rows, self.ok = [], None

        def log(self, row):
            self.rows.append(json.loads(json.dumps(row)))

        def finish(self, ok):
            self.ok = ok

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 2, generator=g), torch.randint(0, 2, (256,), generator=g)
    mine = Mine()
    config = {"train": {"device": "cpu", "threads": 1, "precision": "fp32", "progress": "none", "plots": False,
                        "tensorboard": False, "epochs": 2, "log_every": 4}, "data": {"batch_size": 32}}
    brickyard.fit(torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), (x, y),
                  val_data=(x, y), config=config, run_dir=tmp_path / "r", loggers=[mine])
    assert mine.rows == rows(tmp_path / "r" / "metrics.jsonl") and mine.ok is True
    assert {"start", "train", "val", "epoch", "summary"} <= {r["kind"] for r in mine.rows}


def test_a_logger_that_stalls_mid_run_is_dropped_with_one_warning_and_training_goes_on(tmp_path):
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[hangs, rows]", "train.max_steps=32"), "--run-dir",
                str(run), env=package(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    [warned] = warnings_in(r.stderr)
    assert warned.startswith("warning: train.loggers: hangs did not ") and "within 1 s" in warned, warned
    assert rows(run / "rows.jsonl")[:-1] == rows(run / "metrics.jsonl")


def test_sigterm_while_a_logger_stalls_mid_run_stops_within_seconds(tmp_path):
    run = tmp_path / "r"
    env = {**os.environ, **package(tmp_path), "HANG_AT": "train", "BRICKYARD_LOGGER_TIMEOUT_S": "600"}
    p = subprocess.Popen([sys.executable, "-m", "brickyard", "train", "mnist",
                          *sets(*RUN, "train.loggers=[hangs, rows]", "train.max_steps=1000000", "train.epochs=100000"),
                          "--run-dir", str(run)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "rows.jsonl").is_file() and '"train"' in (run / "rows.jsonl").read_text()):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - sent < 15, err
        assert p.returncode == 130, err
        assert "SIGTERM at step" in err and "did not finish within 2 s; left behind" in err, err
    finally:
        p.kill()


class Silent:
    """A loopback server that takes connections and never answers: it reads the request and sends nothing."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asked, self.conns = threading.Event(), []
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        try:
            if conn.recv(65536):
                self.asked.set()  # an HTTP request came: it never gets an answer
        except OSError:
            pass

    def __exit__(self, *exc):
        self.sock.close()
        for c in self.conns:
            c.close()


@needs_mlflow
def test_a_tracking_server_that_never_answers_is_dropped_with_one_warning_within_seconds(tmp_path):
    run = tmp_path / "r"
    with Silent() as server:
        start = time.monotonic()
        r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[mlflow]"), "--run-dir", str(run), cwd=tmp_path,
                    env={"MLFLOW_TRACKING_URI": server.uri, "BRICKYARD_LOGGER_TIMEOUT_S": "3"}, timeout=300)
        took = time.monotonic() - start
        assert server.asked.is_set()
    assert r.returncode == 0, r.stderr
    assert warnings_in(r.stderr) == ["warning: train.loggers: mlflow did not start within 3 s; dropped, training goes "
                                     "on without it."], r.stderr
    assert (run / "summary.json").is_file() and not (run / "trackers.json").exists()
    assert took < 120  # the process's own start and 12 steps; the client alone retries for about 16 minutes


@needs_mlflow
def test_sigterm_while_a_tracking_server_never_answers_is_heeded_at_once(tmp_path):
    with Silent() as server:
        p = subprocess.Popen([sys.executable, "-m", "brickyard", "train", "mnist", *sets(*RUN, "train.loggers=[mlflow]"),
                              "--run-dir", str(tmp_path / "r")], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "MLFLOW_TRACKING_URI": server.uri, "BRICKYARD_LOGGER_TIMEOUT_S": "600"})
        try:
            assert server.asked.wait(240), "the run never asked the server"
            sent = time.monotonic()
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=60)
            assert time.monotonic() - sent < 10, err
            assert p.returncode != 0
        finally:
            p.kill()
