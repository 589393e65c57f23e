"""Experiment trackers against the real packages: MLflow with a local SQLite store and with a real
`mlflow server` this test starts on loopback, Weights & Biases in offline mode (its run file read back
record by record). Each is skipped with the reason where its package is not installed. fp32, one thread."""
import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import SYNTH, free_port, run_cli, sets

RUN = SYNTH + ["train.max_steps=12", "train.log_every=4", "train.epochs=2"]
have = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
needs_mlflow = pytest.mark.skipif(not have("mlflow"), reason="mlflow not installed (pip install 'brickyard[mlflow]')")
needs_wandb = pytest.mark.skipif(not have("wandb"), reason="wandb not installed (pip install 'brickyard[wandb]')")


def _mlflow_run(uri, run_dir):
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=uri)
    rid = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return client, client.get_run(rid)


def _check_mlflow(uri, run_dir, steps):
    client, run = _mlflow_run(uri, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert run.data.params["optim.lr"] == "0.05" and run.data.params["model.name"] == "mlp"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(4, steps + 1, 4))
    assert run.data.metrics["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert "val_accuracy" in run.data.metrics
    assert run.data.metrics["test_f1_macro"] == pytest.approx(summary["test_f1_macro"])
    assert {"val_f1_macro", "val_balanced_accuracy", "test_precision_macro", "test_recall_macro", "val_ece",
            "test_ece"} <= set(run.data.metrics)
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "summary.json", "metrics.jsonl", "curves.png", "reliability.png"} <= names
    return run.info.run_id


@needs_mlflow
def test_mlflow_with_a_local_store_gets_params_metrics_artifacts_and_a_resume_continues_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "brickyard-test"}
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[mlflow]"), "--run-dir", str(run), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first = _check_mlflow(uri, run, 12)
    again = run_cli("train", *sets("train.max_steps=20"), "--run-dir", str(run), "--resume", "auto", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert _check_mlflow(uri, run, 20) == first  # the same tracker run, its history continued


@needs_mlflow
def test_mlflow_against_a_real_tracking_server(tmp_path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                               "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
                              # no job runner: seven huey consumers of 5 CPU-seconds each, for jobs no tracker sends
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        uri = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the mlflow server did not answer within 60 s")
        run = tmp_path / "r"
        r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[mlflow, tensorboard]"), "--run-dir", str(run),
                    env={"MLFLOW_TRACKING_URI": uri}, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        _check_mlflow(uri, run, 12)
        assert list((tmp_path / "artifacts").rglob("summary.json"))  # stored by the server, not the client
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wandb_records(path):
    """The records of a W&B run file (LevelDB log framing: 7-byte header, 32 KiB blocks, chunks of
    crc32 / length / type), decoded with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2
    data, out, pos, block, pending = open(path, "rb").read(), [], 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@needs_wandb
def test_wandb_offline_writes_the_config_metrics_and_files_and_a_resume_keeps_the_id(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true", "WANDB_PROJECT": "bk"}
    (tmp_path / "wb").mkdir()
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[wandb]"), "--run-dir", str(run), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rid = json.loads((run / "trackers.json").read_text())["wandb"]
    [folder] = glob.glob(str(tmp_path / "wb" / "wandb" / f"offline-run-*-{rid}"))
    records = _wandb_records(glob.glob(f"{folder}/run-{rid}.wandb")[0])
    kinds = [rec.WhichOneof("record_type") for rec in records]
    assert "run" in kinds and "history" in kinds
    config = {u.key: u.value_json for rec in records if rec.WhichOneof("record_type") == "config" for u in rec.config.update}
    assert json.loads(config["optim.lr"]) == 0.05
    history = [(rec.history.step.num, {i.key or "/".join(i.nested_key) for i in rec.history.item})
               for rec in records if rec.WhichOneof("record_type") == "history"]
    assert [s for s, keys in history if "train_loss" in keys] == [4, 8, 12]
    assert any("test_accuracy" in keys for _, keys in history)
    assert os.path.isfile(f"{folder}/files/r/summary.json") and os.path.isfile(f"{folder}/files/r/config.yaml")
    again = run_cli("train", *sets("train.max_steps=16"), "--run-dir", str(run), "--resume", "auto", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "trackers.json").read_text())["wandb"] == rid
    assert len(glob.glob(str(tmp_path / "wb" / "wandb" / f"offline-run-*-{rid}"))) >= 1


def test_a_missing_tracker_package_is_one_sentence_naming_the_extra_and_writes_nothing(tmp_path):
    code = ("import sys; sys.modules['mlflow'] = None\n"
            "import importlib.util; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'mlflow' else real(name, *a)\n"
            "from brickyard.cli.main import main\n"
            f"sys.exit(main(['train', 'mnist', *{sets(*RUN, 'train.loggers=[mlflow]')!r}, '--run-dir', {str(tmp_path / 'r')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "error: train.loggers: mlflow needs the mlflow package: pip install 'brickyard[mlflow]'."
    assert not (tmp_path / "r").exists()
    bad = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[neptune]"), "--run-dir", str(tmp_path / "b"))
    assert bad.returncode == 2 and "train.loggers: 'neptune' is not one of tensorboard, csv, mlflow, wandb." in bad.stderr


@needs_mlflow
def test_a_tracking_server_that_takes_no_connection_is_one_sentence_within_seconds_and_writes_nothing(tmp_path):
    """MLflow's client retries a refused connection for about four minutes; the run says so at once."""
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[mlflow]"), "--run-dir", str(tmp_path / "r"),
                env={"MLFLOW_TRACKING_URI": uri}, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: train.loggers: mlflow: no tracking server answers at {uri} (Connection refused); start it, or point "
        f"MLFLOW_TRACKING_URI at one (a local store: sqlite:///mlflow.db).")
    assert time.monotonic() - start < 60 and not (tmp_path / "r").exists()


@needs_wandb
def test_an_online_wandb_server_that_takes_no_connection_is_one_sentence_and_offline_needs_none(tmp_path):
    """wandb.init retries a refused connection for about 100 s (an API key set); the run says so at once. The
    server comes from WANDB_BASE_URL here, as from `wandb login --host`'s settings file."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"WANDB_BASE_URL": url, "WANDB_API_KEY": "a" * 40, "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true",
           "WANDB_MODE": "online"}
    start = time.monotonic()
    r = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[wandb]"), "--run-dir", str(tmp_path / "r"), env=env,
                cwd=tmp_path, timeout=150)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: train.loggers: wandb: no W&B server answers at {url} (Connection refused); set WANDB_MODE=offline to "
        f"keep the run under RUN_DIR/wandb and `wandb sync` it later, or WANDB_BASE_URL to your server."), r.stderr
    assert time.monotonic() - start < 60 and not (tmp_path / "r").exists()
    offline = run_cli("train", "mnist", *sets(*RUN, "train.loggers=[wandb]", "train.max_steps=2"), "--run-dir",
                      str(tmp_path / "o"), env={**env, "WANDB_MODE": "offline"}, cwd=tmp_path, timeout=150)
    assert offline.returncode == 0, offline.stderr


# `brickyard train --resume auto` on one run directory once for each tracker record written before it, in one
# process (torch and MLflow imported once, not once a record): each command's exit code, what it wrote to stderr
# and the record after it, as JSON lines on stdout
RESUMES_WITH_RECORDS = """
import contextlib, io, json, sys
from pathlib import Path
from brickyard.cli.main import main
run, record = sys.argv[1], Path(sys.argv[1]) / "trackers.json"
for text in json.loads(sys.argv[2]):
    record.write_text(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--set", "train.max_steps=16", "--run-dir", run, "--resume", "auto"])
    print(json.dumps({"code": code, "stderr": err.getvalue(), "record": record.read_text()}), flush=True)
"""


@needs_mlflow
def test_a_damaged_or_foreign_tracker_record_is_one_sentence_and_the_run_is_left_as_it_was(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    run = tmp_path / "r"
    assert run_cli("train", "mnist", *sets(*RUN, "train.loggers=[mlflow]"), "--run-dir", str(run), env=env,
                   cwd=tmp_path).returncode == 0
    record = run / "trackers.json"
    before = {p.name: p.read_bytes() for p in (run / "metrics.jsonl", run / "summary.json")}
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    # cut short, not an object, an id that is not a string; then a run of another store (MLFLOW_TRACKING_URI changed)
    texts = ['{"mlflow": ', '["x"]', '{"mlflow": 5}', '{"mlflow": "0123abcd"}']
    r = subprocess.run([sys.executable, "-c", RESUMES_WITH_RECORDS, str(run), json.dumps(texts)], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path, env={**os.environ, **env})
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    said = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [s["record"] for s in said] == texts, r.stdout[-3000:]  # each record left as it was
    for s in said[:3]:
        assert s["code"] != 0 and s["stderr"].strip() == (
            f"error: {record} is not a record of tracker run ids ({{\"mlflow\": \"ID\", ...}}); delete it to start new "
            f"tracker runs, or put back the ids of the runs to continue."), s["stderr"]
    foreign = said[3]["stderr"]
    assert said[3]["code"] != 0 and foreign.startswith(
        f"error: train.loggers: mlflow could not start a run at {uri}: the run 0123abcd that {record} names is not there ("), foreign
    assert "point MLFLOW_TRACKING_URI at the store this run used" in foreign
    assert {p.name: p.read_bytes() for p in (run / "metrics.jsonl", run / "summary.json")} == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == steps


@needs_mlflow
def test_the_server_check_leaves_a_proxied_uri_to_mlflow(monkeypatch):
    """Behind HTTP_PROXY the requests go through the proxy, so a direct connection proves nothing; NO_PROXY
    hosts are checked."""
    from brickyard.callbacks.trackers import check_reachable
    from brickyard.errors import ConfigError
    for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)
    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ConfigError, match="no tracking server answers"):
        check_reachable(["mlflow"], timeout=5)
    check_reachable(["tensorboard"])  # MLflow not asked for: nothing tried
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    check_reachable(["mlflow"], timeout=5)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with pytest.raises(ConfigError, match="no tracking server answers"):
        check_reachable(["mlflow"], timeout=5)
