import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from brickyard import api
from brickyard.config import load_config
from brickyard.errors import CheckpointError, DeviceError
from brickyard.files import write_torch
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, SYNTH, run_cli, sets

DETERMINISTIC = SYNTH + ["train.deterministic=true", "train.epochs=3", "train.log_every=1",
                         "data.augment=shift", "optim.name=momentum", "schedule.name=onecycle"]


def _final_weights(run_dir):
    return checkpoint.load(checkpoint.step_checkpoints(run_dir / "checkpoints")[-1])["model"]


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.fast
def test_run_writes_every_file(tmp_path):
    run = tmp_path / "run"
    summary = api.train_config(load_config("mnist", SYNTH + ["train.epochs=2"]), run)
    for name in ("config.yaml", "env.json", "metrics.jsonl", "train.log", "summary.json", "logs/workerlog.0"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "best.pt").is_file()
    saved = json.loads((run / "summary.json").read_text())
    for key in ("test_accuracy", "val_accuracy", "test_loss", "epochs", "steps", "train_seconds", "wall_seconds",
                "images_per_second", "device", "world_size", "precision"):
        assert key in saved, key
    assert saved["steps"] == 2 * 16 and saved["world_size"] == 1 and saved["test_accuracy"] > 0.5
    kinds = [json.loads(l)["kind"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("val") == 2 and "test" in kinds and "train" in kinds
    env = json.loads((run / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["seed"] == 0
    assert env["allocator"] == ("glibc heap kept" if sys.platform.startswith("linux") else "default")
    assert load_config(str(run / "config.yaml")).optim == load_config("mnist", SYNTH).optim
    assert summary["test_accuracy"] == saved["test_accuracy"]


@pytest.mark.fast
def test_resume_from_a_mid_epoch_checkpoint_is_exact(tmp_path):
    cfg = load_config("mnist", DETERMINISTIC + ["checkpoint.every_steps=5", "checkpoint.keep_last=100"])
    api.train_config(cfg, tmp_path / "full")
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "checkpoints" / "step-0000020.pt", resumed / "checkpoints")  # step 20 = epoch 1, batch 4
    summary = api.train_config(cfg, resumed, resume="auto")
    assert summary["steps"] == 48
    assert _same(_final_weights(tmp_path / "full"), _final_weights(resumed))


def test_sigterm_saves_and_resume_equals_uninterrupted(tmp_path):
    args = ["train", "mnist", *sets(*DETERMINISTIC, "train.epochs=6", "data.synthetic.num_train=2048")]
    reference = run_cli(*args, "--run-dir", str(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "brickyard", *args, "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"train"') >= 30):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "SIGTERM at step" in err and "--resume auto" in err
    assert len(err.strip().splitlines()) == 1
    stopped_at = checkpoint.load(checkpoint.step_checkpoints(run / "checkpoints")[-1])["step"]
    assert 30 <= stopped_at < 6 * 64
    again = run_cli(*args, "--run-dir", str(run), "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert _same(_final_weights(tmp_path / "ref"), _final_weights(run))
    assert json.loads((run / "summary.json").read_text())["steps"] == 6 * 64


def test_auto_resume_skips_a_corrupt_newest_checkpoint(tmp_path):
    cfg = load_config("mnist", SYNTH + ["train.epochs=2"])
    run = tmp_path / "run"
    api.train_config(cfg, run)
    files = checkpoint.step_checkpoints(run / "checkpoints")
    assert len(files) == 2
    files[-1].write_bytes(files[-1].read_bytes()[:100])  # a crash mid-write (without our atomic rename)
    result = run_cli("train", "mnist", *sets(*SYNTH, "train.epochs=2"), "--run-dir", str(run), "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "cannot be read" in result.stderr and "Falling back" in result.stderr
    assert "resumed from" in result.stdout and files[0].name in result.stdout


def test_incompatible_checkpoint_names_the_mismatch(tmp_path):
    run = tmp_path / "run"
    api.train_config(load_config("mnist", SYNTH + ["train.epochs=1"]), run)
    path = checkpoint.step_checkpoints(run / "checkpoints")[-1]
    with pytest.raises(CheckpointError, match="does not fit this model"):
        api.train_config(load_config("mnist", SYNTH + ["model.name=mnist_cnn"]), tmp_path / "b", resume=str(path))
    result = run_cli("train", "mnist", *sets(*SYNTH, "model.name=lenet"), "--run-dir", str(tmp_path / "c"), "--resume", str(path))
    assert result.returncode == 2 and result.stderr.startswith("error: checkpoint") and len(result.stderr.splitlines()) == 1


def test_checkpoints_cannot_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Evil()}, path)
    with pytest.raises(CheckpointError, match=r"holds Python objects besides tensors \(such as (posix|os)\.system\), which "
                                              r"brickyard does not unpickle"):
        checkpoint.load(path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.fast
def test_a_file_torch_save_did_not_write_is_named(tmp_path):
    good = tmp_path / "good.pt"
    write_torch({"model": {"w": torch.ones(1000)}}, good)
    cut, other = tmp_path / "cut.pt", tmp_path / "digit.png"
    cut.write_bytes(good.read_bytes()[:500])
    other.write_bytes(b"\x89PNG not a checkpoint")
    for path in (cut, other):
        with pytest.raises(CheckpointError, match="it is not a file written by torch.save"):
            checkpoint.load(path)
    assert checkpoint.load(good)["model"]["w"].sum() == 1000


@pytest.mark.fast
def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "step-0000001.pt"
    write_torch({"model": {"w": torch.ones(2)}}, path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        write_torch({"model": {}, "x": Boom()}, path)
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("opt, sched", [("sgd", "step"), ("adagrad", "cosine"), ("adadelta", "constant"),
                                        ("adam", "warmup_linear"), ("adamw", "onecycle"), ("nesterov", "cosine")])
@pytest.mark.fast
def test_optimisers_and_schedules_learn(tmp_path, opt, sched):
    lr = {"adadelta": 1.0, "adam": 0.002, "adamw": 0.002, "adagrad": 0.02}.get(opt, 0.05)
    s = api.train_config(load_config("mnist", SYNTH + [f"optim.name={opt}", f"schedule.name={sched}", f"optim.lr={lr}",
                                                       "schedule.warmup_epochs=0.5", "train.epochs=2",
                                                       "optim.label_smoothing=0.1", "train.grad_clip=1.0"]), tmp_path)
    assert s["test_accuracy"] > 0.5


@pytest.mark.fast
def test_grad_accumulation_matches_big_batch(tmp_path):
    base = SYNTH + ["train.deterministic=true", "train.epochs=1", "optim.weight_decay=0", "optim.name=sgd", "schedule.name=constant"]
    api.train_config(load_config("mnist", base + ["data.batch_size=64"]), tmp_path / "big")
    api.train_config(load_config("mnist", base + ["data.batch_size=32", "train.grad_accum=2"]), tmp_path / "acc")
    a, b = _final_weights(tmp_path / "big"), _final_weights(tmp_path / "acc")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=ACROSS_ORDERS) for k in a)


@pytest.mark.fast
def test_schedules_shape():
    from brickyard.config import ScheduleConfig
    from brickyard.optim import Schedule
    s = Schedule(ScheduleConfig(name="warmup_linear", lr_init=0.01, warmup_epochs=1, lr_end=0.0), 0.1, 100, 10)
    assert s(0) == pytest.approx(0.01) and s(10) == pytest.approx(0.1) and s(100) == pytest.approx(0.0)
    st = Schedule(ScheduleConfig(name="step", step_epochs=2, gamma=0.5), 0.1, 100, 10)
    assert st(19) == pytest.approx(0.1) and st(20) == pytest.approx(0.05)
    oc = Schedule(ScheduleConfig(name="onecycle", pct_start=0.25), 0.1, 100, 10)
    assert oc(25) == pytest.approx(0.1) and oc(0) == pytest.approx(0.004) and oc(100) == pytest.approx(0.0)


@pytest.mark.fast
def test_devices_that_do_not_exist():
    from brickyard.training.device import resolve_device, resolve_precision
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only machine")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda:3")
    with pytest.raises(DeviceError, match="not one of auto, cpu"):
        resolve_device("tpu")
    with pytest.raises(DeviceError, match="needs a CUDA device"):
        resolve_precision("fp16", torch.device("cpu"))
    assert resolve_device("auto").type == "cpu"


@pytest.mark.fast
def test_fit_with_user_model_and_tensors(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(256, 1, 8, 8)
    y = (x.mean((1, 2, 3)) > 0).long()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2))
    summary = api.fit(model, (x, y), val_data=(x[:64], y[:64]), test_data=(x[:64], y[:64]),
                      config={"train": {"epochs": 3, "device": "cpu", "progress": "none"}, "data": {"batch_size": 32},
                              "optim": {"lr": 0.02}},  # a dict config gets torch's Adam (lr 1e-3): this one states its rate
                      run_dir=tmp_path / "fit")
    assert summary["test_accuracy"] > 0.8 and (tmp_path / "fit" / "summary.json").is_file()


@pytest.mark.fast
def test_fit_and_predict_take_keras_channels_last_arrays(tmp_path):
    """keras.datasets.cifar10 gives 50000 x 32 x 32 x 3 uint8 and 50000 x 1 labels; fit reads them as
    N x C x H x W (a view), so a conv net, the crop-flip augmentation and predict see channels where torch
    puts them. The class is the bright channel: learnable only if the channels are read as channels.
    fp32, one process, seed 0."""
    import numpy as np

    import brickyard
    g = np.random.default_rng(0)
    y = g.integers(0, 3, (900, 1))
    x = (g.random((900, 16, 16, 3)) * 100).astype(np.uint8)
    x[np.arange(900), :, :, y[:, 0]] += 120
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 3))
    summary = api.fit(model, (x[:700], y[:700]), test_data=(x[700:], y[700:]),
                      config={"train": {"epochs": 3, "device": "cpu", "progress": "none", "precision": "fp32", "threads": 1},
                              "optim": {"lr": 0.05}, "data": {"augment": "crop-flip"}}, run_dir=tmp_path / "fit")
    assert summary["test_accuracy"] > 0.95, summary["test_accuracy"]
    assert "(channels last, as Keras keeps images) and the model takes channels first: read as 3x16x16" in \
        (tmp_path / "fit" / "train.log").read_text()
    out = brickyard.predict(model, x[700:760])  # the uint8 arrays fit took, as they are
    assert (out["predicted"].numpy() == y[700:760, 0]).mean() > 0.95
    # a model that takes channels-last images itself keeps them as they are; an MLP reads any layout as given
    class Permutes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*list(model))
        def forward(self, x):
            return self.net(x.permute(0, 3, 1, 2))
    summary = api.fit(Permutes(), (x[:700], y[:700]), test_data=(x[700:], y[700:]),
                      config={"train": {"epochs": 1, "device": "cpu", "progress": "none", "precision": "fp32", "threads": 1},
                              "optim": {"lr": 0.05}}, run_dir=tmp_path / "permutes")
    assert summary["test_accuracy"] > 0.95 and "channels last" not in (tmp_path / "permutes" / "train.log").read_text()
    from brickyard.data.layout import model_reads_channels_last
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 3, 3))
    assert not model_reads_channels_last(mlp, torch.zeros(2, 16, 16, 3)) and mlp.training


@pytest.mark.fast
def test_fit_takes_bytes_that_are_not_images_as_it_takes_their_floats(tmp_path):
    """N x F uint8 features (not images): scaled to [0, 1] as images' bytes are, so the same weights as x / 255.0;
    the images' 1 x C x 1 x 1 mean and std made this a RuntimeError in the batch's preparation. fp32, one thread."""
    import numpy as np
    x, y = np.random.default_rng(0).integers(0, 256, (64, 4)).astype(np.uint8), np.arange(64) % 3
    cfg = {"train": {"max_steps": 3, "device": "cpu", "progress": "none", "plots": False, "tensorboard": False,
                     "precision": "fp32", "threads": 1}, "data": {"batch_size": 16}}
    weights = []
    for name, inputs in (("bytes", x), ("floats", (x / 255.0).astype(np.float32))):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        s = api.fit(model, (inputs, y), val_data=(inputs, y), config=cfg, run_dir=tmp_path / name)
        assert s["steps"] == 3 and s["val_accuracy"] is not None
        weights.append(model.state_dict())
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0])


@pytest.mark.fast
def test_predict_reads_a_modules_inputs_as_fit_trained_it(tmp_path):
    """fit scales uint8 images to [0, 1]; predict on the module fed them as 0..255 floats, so a model with batch norm
    scored 75.5% through predict against fit's own 84.95% on the same MNIST images. Now bytes, 0..255 int64 images
    and x / 255.0 give the same probabilities, those of fit's test pass; token ids reach an embedding as integers, and
    a float64 model takes its inputs (a dtype error before). fp32, one thread, seed 0."""
    import numpy as np

    import brickyard
    g = np.random.default_rng(0)
    y = g.integers(0, 3, 400)
    x = (g.random((400, 1, 8, 8)) * 120).astype(np.uint8)
    x[np.arange(400), 0, 2 * y, 3] = 255  # the class is where the bright pixel is
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3))
    s = api.fit(model, (x[:300], y[:300]), test_data=(x[300:], y[300:]), config={"train": {
        "epochs": 4, "device": "cpu", "progress": "none", "precision": "fp32", "threads": 1, "plots": False},
        "data": {"batch_size": 30}, "optim": {"lr": 0.01}}, run_dir=tmp_path / "r")
    probs = [brickyard.predict(model, v)["probabilities"] for v in (x[300:], x[300:].astype(np.int64), x[300:] / 255.0)]
    assert all(torch.allclose(p, probs[0], atol=1e-6) for p in probs)
    assert (probs[0].argmax(1).numpy() == y[300:]).mean() == pytest.approx(s["test_accuracy"])
    assert s["test_accuracy"] > 0.9, s["test_accuracy"]
    ids = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(12, 2))
    assert brickyard.predict(ids, torch.randint(0, 10, (5, 3)))["predicted"].shape == (5,)
    assert brickyard.predict(model.double(), x[300:310])["predicted"].tolist() == probs[0][:10].argmax(1).tolist()


def test_fit_reads_numpys_dtypes_as_the_model_takes_them(tmp_path):
    """A course's `x / 255.0` is float64, `np.array(pixels)` int64: fit reads floats (float64, float16, booleans) as
    the model's dtype, and integer images of 0..255 as the bytes they are, so each trains the weights of the
    same images given as uint8 or float32 (Keras casts inputs to its layers' dtype too). A Dataset's float64
    batches are cast on the device; a float64 model keeps float64. fp32, one thread, seed 0."""
    import numpy as np
    g = np.random.default_rng(0)
    y = g.integers(0, 3, 300)
    x = (g.random((300, 8, 8)) * 80).astype(np.uint8)
    x[np.arange(300), y * 2, :] = 250  # the class is which row is bright

    def fit(inputs, name, model=None, **kw):
        torch.manual_seed(0)
        model = model or torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
        cfg = {"train": {"epochs": 2, "device": "cpu", "progress": "none", "precision": "fp32", "threads": 1, "plots": False,
                         "tensorboard": False}, "optim": {"lr": 0.05}, "data": {"batch_size": 30}}
        summary = api.fit(model, inputs, test_data=kw.get("test", (x, y)), config=cfg, run_dir=tmp_path / name)
        return model, summary, (tmp_path / name / "train.log").read_text()

    ref, s, _ = fit((x, y), "uint8")
    assert s["test_accuracy"] > 0.9, s
    for given, name, note, exact in [
            (x.astype(np.int64), "int64", "images of int64 with values 0..255 read as bytes (uint8), scaled to [0, 1]", True),
            (x / 255.0, "float64", "inputs of float64 read as float32, the model's dtype", False),
            ((x / 255.0).astype(np.float16), "float16", "inputs of float16 read as float32, the model's dtype", None)]:
        model, s, log = fit((given, y), name, test=(given, y))
        assert note in log, log
        assert s["test_accuracy"] > 0.9, (name, s)
        if exact is not None:  # float64 / 255 rounds once to float32 where the bytes are divided in float32
            diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
            assert diff == 0 if exact else diff < 1e-5, (name, diff)
    _, s, _ = fit((x, [int(v) for v in y]), "list")  # labels gathered in a Python list
    assert s["test_accuracy"] > 0.9
    from brickyard.errors import DataError
    with pytest.raises(DataError, match=r"train_data: the labels are names \('[abc]', \.\.\.\); give class indices 0..K-1"):
        fit((x, ["abc"[v] for v in y]), "names")
    _, s, log = fit((x > 128, y), "bool", test=(x > 128, y))
    assert "inputs of bool read as float32" in log and s["test_accuracy"] > 0.9
    data = torch.utils.data.TensorDataset(torch.from_numpy(x / 255.0)[:, None], torch.from_numpy(y))
    _, s, _ = fit(data, "dataset", test=data)  # float64 batches from a Dataset: cast as they reach the device
    assert s["test_accuracy"] > 0.9
    model, s, log = fit((x / 255.0, y), "double", model=torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3)).double())
    assert s["test_accuracy"] > 0.9 and next(model.parameters()).dtype == torch.float64 and "read as" not in log


@pytest.mark.fast
def test_fit_holds_out_data_val_fraction_of_its_tensors_at_random_and_refuses_it_beside_val_data(tmp_path):
    """data.val_fraction for fit: a seeded random fifth of the tensors, kept in order, as an image folder's; samples
    sorted by class (where Keras's validation_split, the last fifth, would hold out one class) give both classes."""
    import numpy as np

    from brickyard.errors import DataError
    y = np.repeat([0, 1], 50)  # sorted by class
    x = np.arange(100, dtype=np.uint8).reshape(100, 1, 1).repeat(4, 1).repeat(4, 2)  # each image holds its index
    cfg = {"train": {"max_steps": 1, "device": "cpu", "progress": "none", "plots": False, "tensorboard": False},
           "data": {"val_fraction": 0.2, "batch_size": 16}}
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
    s = api.fit(model, (x, y), config=cfg, run_dir=tmp_path / "a")
    assert s["val_accuracy"] is not None
    assert "data user: 80 train / 20 val / 0 test" in (tmp_path / "a" / "train.log").read_text()
    from brickyard.data import from_user
    d = from_user((x, y), model=model, transforms=api.resolve_config(cfg).data)
    held = d.val.images[:, 0, 0, 0].tolist()
    assert held == sorted(held) and len(held) == 20 and set(d.val.labels.tolist()) == {0, 1}
    assert sorted(held + d.train.images[:, 0, 0, 0].tolist()) == list(range(100))  # each sample in one split
    assert from_user((x, y), model=model, transforms=api.resolve_config(cfg).data).val.images.equal(d.val.images)  # seeded
    with pytest.raises(DataError, match="data.val_fraction holds out 0.2 of train_data, and val_data is given too"):
        api.fit(model, (x, y), val_data=(x, y), config=cfg, run_dir=tmp_path / "b")
    with pytest.raises(DataError, match="for a Dataset pass val_data"):
        api.fit(model, torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), config=cfg,
                run_dir=tmp_path / "c")


@pytest.mark.fast
def test_fit_takes_keras_epochs_batch_size_and_validation_split(tmp_path):
    """``fit(model, (x, y), epochs=2, batch_size=32, validation_split=0.2)`` as a Keras user writes it (a TypeError
    before): the keywords set train.epochs, data.global_batch_size and data.val_fraction over the config, and a bad
    value is the config's own sentence."""
    import numpy as np

    from brickyard.errors import ConfigError
    x, y = np.random.default_rng(0).random((100, 4), dtype=np.float32), np.arange(100) % 3
    cfg = {"train": {"epochs": 9, "device": "cpu", "progress": "none", "plots": False, "tensorboard": False,
                     "precision": "fp32", "threads": 1}}
    s = api.fit(torch.nn.Linear(4, 3), (x, y), config=cfg, run_dir=tmp_path / "a", epochs=2, batch_size=32,
                validation_split=0.2)
    log = (tmp_path / "a" / "train.log").read_text()
    assert "data user: 80 train / 20 val / 0 test" in log and "global batch 32 (32 per device x 1 x 1 accumulation)" in log
    assert s["steps"] == 2 * 3 and s["val_accuracy"] is not None  # 80 samples in batches of 32: 3 steps an epoch
    with pytest.raises(ConfigError, match="train.epochs: -1 is below the minimum"):
        api.fit(torch.nn.Linear(4, 3), (x, y), config=cfg, run_dir=tmp_path / "b", epochs=-1)
    assert not (tmp_path / "b").exists()


@pytest.mark.fast
def test_fit_takes_keras_validation_data_validation_freq_and_verbose(tmp_path, capsys):
    """``validation_data=(x_val, y_val)`` is ``val_data``, ``validation_freq`` ``train.eval_every`` and ``verbose`` 0
    / 1 / 2 ``train.progress`` none / bar / plain, as Keras's ``fit`` takes them; ``fit(model, x, y)`` as Keras
    writes it, sample weights in the validation data, both names at once and a verbose Keras does not have are
    one sentence, before anything is written."""
    import numpy as np

    from brickyard.errors import ConfigError, DataError
    x, y = np.random.default_rng(0).random((100, 4), dtype=np.float32), np.arange(100) % 3
    cfg = {"train": {"device": "cpu", "plots": False, "tensorboard": False, "precision": "fp32", "threads": 1,
                     "log_every": 1000}}
    s = api.fit(torch.nn.Linear(4, 3), (x[:80], y[:80]), config=cfg, run_dir=tmp_path / "a", epochs=4, batch_size=40,
                validation_data=(x[80:], y[80:]), validation_freq=2, verbose=2)
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [4, 8] and s["val_accuracy"] is not None
    assert "epoch 2 step 4 val loss" in capsys.readouterr().out  # verbose 2: plain lines
    api.fit(torch.nn.Linear(4, 3), (x, y), config=cfg, run_dir=tmp_path / "quiet", epochs=1, verbose=0)
    assert "epoch 1 step" not in capsys.readouterr().out  # verbose 0: the run's set-up lines, no progress
    bad = {"keras-order": ((x, y), {}, "fit takes the training data as one (inputs, labels) pair, fit(model, (x, y))"),
           "weights": (((x, y),), dict(validation_data=(x, y, np.ones(100))), "validation_data: (x, y, sample_weight)"),
           "both": (((x, y), (x, y)), dict(validation_data=(x, y)), "val_data and validation_data (Keras's name) are"),
           "verbose": (((x, y),), dict(verbose=3), "verbose: 3 is not one of Keras's 0 (silent), 1 (a progress bar)")}
    for name, (data, kwargs, said) in bad.items():
        with pytest.raises((ConfigError, DataError), match=re.escape(said)):
            api.fit(torch.nn.Linear(4, 3), *data, config=cfg, run_dir=tmp_path / name, **kwargs)
        assert not (tmp_path / name).exists()


@pytest.mark.fast
def test_fit_keeps_the_classes_and_images_a_class_that_data_classes_and_train_per_class_name(tmp_path):
    """data.classes and data.train_per_class work on every data set held as tensors, fit's too (they were ignored)."""
    import numpy as np

    from brickyard.data import from_user
    from brickyard.errors import DataError
    g = np.random.default_rng(0)
    x, y = (g.random((90, 4, 4)) * 255).astype(np.uint8), np.arange(90) % 3
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    cfg = api.resolve_config({"data": {"classes": [0, 2], "train_per_class": 5}})
    d = from_user((x, y), test=(x, y), model=model, transforms=cfg.data)
    assert len(d.train) == 10 and d.num_classes == 2 and sorted(d.train.labels.tolist()) == [0] * 5 + [1] * 5
    assert len(d.test) == 60 and set(d.test.labels.tolist()) == {0, 1}  # the test split keeps every image of both
    with pytest.raises(DataError, match="data.classes and data.train_per_class work on data sets held as tensors"):
        from_user(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), model=model, transforms=cfg.data)


@pytest.mark.fast
def test_fit_with_a_dataset(tmp_path):
    x = torch.randn(128, 1, 4, 4)
    y = (x.sum((1, 2, 3)) > 0).long()
    ds = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
    summary = api.fit(model, ds, test_data=ds, num_classes=2, run_dir=tmp_path / "ds",
                      config={"train": {"epochs": 2, "device": "cpu", "progress": "none"},
                              "data": {"batch_size": 16, "num_workers": 0}})
    assert summary["steps"] == 16 and summary["test_accuracy"] is not None


@pytest.mark.fast
def test_log_every_auto_reads_the_loss_about_fifty_times_a_run():
    from brickyard.training.resolve import log_every
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [log_every("auto", n, cpu) for n in (294, 10, 100_000)] == [6, 1, 2000]  # the default run: 49 points, not 3
    assert log_every("auto", 294, cuda) == 10 and log_every("auto", 100_000, cuda) == 2000  # never a sync a step on a GPU
    assert log_every(7, 294, cuda) == 7


def test_a_run_of_auto_log_every_writes_fifty_training_rows_and_says_its_choice_in_the_config_it_ran(tmp_path):
    r = run_cli("train", *sets(*SYNTH, "train.epochs=7", "train.max_steps=100", "train.plots=false"),
                "--run-dir", str(tmp_path / "r"))  # 16 steps an epoch: 100 steps, log_every auto
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["kind"] == "train"] == list(range(2, 101, 2))
