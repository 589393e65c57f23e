"""brickyard against what its users would pick instead: the default MNIST recipe written the way each
framework's users write it, run interleaved with `brickyard train` on the same machine.

The recipe is the `mnist` preset's: the mnist_fast net, MNIST normalised (0.1307, 0.3081), 50,000
training images, batch 256, Adam lr 0.02 betas (0.7, 0.9), cross-entropy with label smoothing 0.1, a
one-cycle schedule (25% rising) over 1.5 epochs, validation on 10,000 images at the end of each
epoch and of the run, the test set at the end. The peers:

- **PyTorch Lightning**: a `LightningModule` (`training_step`, `validation_step`, `test_step`,
  `configure_optimizers` returning `{"optimizer", "lr_scheduler": {"scheduler", "interval": "step"}}`, the
  dict form of `lightning/pytorch/core/module.py` 2.6.6, `configure_optimizers` docstring, lines 990-1017,
  whose "interval" steps `OneCycleLR` per batch) and `Trainer(max_steps=...)`, the data as
  `DataLoader(TensorDataset(...), batch_size=256, shuffle=True)`;
- **Accelerate**: `Accelerator()` and `accelerator.prepare(model, optimizer, loader, scheduler)` (accelerate
  1.15.0 `accelerator.py`, `prepare` at line 1415), a plain loop with `accelerator.backward(loss)` (line 2829).

Each row times the whole command (process start to exit), the training loop (the steps only: from the
start of an epoch to its last step, evaluation excluded, as brickyard's `train_seconds`) and reads the
test accuracy. "default" runs each at its own default precision (brickyard `auto`, the others fp32);
"fp32" pins all three. The peers run in a venv of their own (`--venv`, made on first use with
`pip install torch==<this torch> lightning accelerate`, which never changes the torch installed here).

    python benchmarks/peers.py [--rounds 3] [--venv .cache/peers-venv] [--only default|fp32] [--device cuda]
                               [--python PY]   # an interpreter with lightning and accelerate, in place of --venv
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = r'''
import gzip, json, math, os, sys, time
from pathlib import Path
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS_PER_EPOCH = math.ceil(50000 / 256)
TOTAL = math.ceil(1.5 * STEPS_PER_EPOCH)

def mnist():
    root = Path(os.environ["BRICKYARD_DATA"]) / "mnist"
    def read(name, offset):
        return np.frombuffer(gzip.decompress((root / name).read_bytes()), np.uint8, offset=offset)
    x = torch.from_numpy(read("train-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28).copy())
    y = torch.from_numpy(read("train-labels-idx1-ubyte.gz", 8).astype(np.int64))
    xt = torch.from_numpy(read("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28).copy())
    yt = torch.from_numpy(read("t10k-labels-idx1-ubyte.gz", 8).astype(np.int64))
    norm = lambda a: (a.float() / 255 - 0.1307) / 0.3081
    return (norm(x[:50000]), y[:50000]), (norm(x[50000:]), y[50000:]), (norm(xt), yt)

def mnist_fast():
    return nn.Sequential(nn.Conv2d(1, 16, 5, stride=2, padding=2), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64 * 3 * 3, 10))

def optimiser(model):
    opt = torch.optim.Adam(model.parameters(), lr=0.02, betas=(0.7, 0.9))
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=TOTAL, pct_start=0.25)
'''

LIGHTNING = COMMON + r'''
import lightning as L
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mnist_fast()
    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y, label_smoothing=0.1)
    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())
    def test_step(self, batch, i):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(1) == y).float().mean())
    def configure_optimizers(self):
        opt, sched = optimiser(self)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

class LoopClock(L.Callback):  # the steps only, as brickyard's train_seconds: evaluation excluded
    seconds = 0.0
    def on_train_epoch_start(self, trainer, module):
        self.t = time.perf_counter()
    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        now = time.perf_counter(); self.seconds += now - self.t; self.t = now

torch.manual_seed(0)
train, val, test = mnist()
clock = LoopClock()
trainer = L.Trainer(max_steps=TOTAL, precision=sys.argv[1], accelerator="gpu" if sys.argv[2] == "cuda" else "cpu", devices=1, callbacks=[clock],
                    enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)
model = Net()
trainer.fit(model, DataLoader(TensorDataset(*train), batch_size=256, shuffle=True), DataLoader(TensorDataset(*val), batch_size=250))
acc = trainer.test(model, DataLoader(TensorDataset(*test), batch_size=250), verbose=False)[0]["test_acc"]
print("RESULT " + json.dumps({"loop_seconds": clock.seconds, "test_accuracy": acc}))
'''

ACCELERATE = COMMON + r'''
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
accelerator = Accelerator(mixed_precision=sys.argv[1], cpu=sys.argv[2] != "cuda")
train, val, test = mnist()
model = mnist_fast()
opt, sched = optimiser(model)
loader = DataLoader(TensorDataset(*train), batch_size=256, shuffle=True)
val_loader, test_loader = DataLoader(TensorDataset(*val), batch_size=250), DataLoader(TensorDataset(*test), batch_size=250)
model, opt, loader, sched, val_loader, test_loader = accelerator.prepare(model, opt, loader, sched, val_loader, test_loader)

def accuracy(dl):
    model.eval(); right = n = 0
    with torch.no_grad():
        for x, y in dl:
            right += (model(x).argmax(1) == y).sum().item(); n += len(y)
    model.train(); return right / n

step, loop = 0, 0.0
while step < TOTAL:
    t = time.perf_counter()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        accelerator.backward(loss)
        opt.step(); sched.step(); opt.zero_grad()
        step += 1
        if step >= TOTAL:
            break
    loop += time.perf_counter() - t
    accuracy(val_loader)  # the validation users write at each epoch's end
print("RESULT " + json.dumps({"loop_seconds": loop, "test_accuracy": accuracy(test_loader)}))
'''


def venv_python(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.exists():
        return py
    import torch
    pinned = torch.__version__.split("+")[0]
    print(f"making {venv}: torch=={pinned} lightning accelerate (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={pinned}", "lightning", "accelerate"], check=True)
    return py


def timed(cmd, env, cwd) -> tuple[float, str]:
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:3]))} failed:\n{r.stderr[-2000:]}")
    return wall, r.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--venv", default=str(ROOT / ".cache" / "peers-venv"))
    p.add_argument("--only", choices=("default", "fp32"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where all three train (one device)")
    p.add_argument("--python", help="an interpreter that has lightning and accelerate (instead of --venv)")
    args = p.parse_args()
    py = Path(args.python) if args.python else venv_python(Path(args.venv))
    env = dict(os.environ)
    env.setdefault("BRICKYARD_DATA", str(ROOT.parent / "shared" / "datasets"))
    work = Path(tempfile.mkdtemp(prefix="brickyard-peers-"))
    (work / "lightning_mnist.py").write_text(LIGHTNING)
    (work / "accelerate_mnist.py").write_text(ACCELERATE)
    found = subprocess.run([str(py), "-c", "import lightning, accelerate, torch; print(lightning.__version__, "
                            "accelerate.__version__, torch.__version__)"], capture_output=True, text=True)
    versions = found.stdout.split()
    if found.returncode != 0 or len(versions) != 3:
        raise SystemExit(f"error: {py} cannot import lightning and accelerate: {found.stderr.strip().splitlines()[-1:]}")
    print(f"Lightning {versions[0]}, Accelerate {versions[1]} (torch {versions[2]}); brickyard with torch "
          f"{__import__('torch').__version__}; {args.rounds} rounds, commands interleaved", flush=True)
    brickyard = [sys.executable, "-m", "brickyard", "train", "--device", args.device, "--set", "train.plots=false",
                 "--set", "train.tensorboard=false"]
    dev = [args.device]
    rows = {"default": {"brickyard": brickyard, "Lightning": [str(py), str(work / "lightning_mnist.py"), "32-true", *dev],
                        "Accelerate": [str(py), str(work / "accelerate_mnist.py"), "no", *dev]},
            "fp32": {"brickyard": brickyard + ["--set", "train.precision=fp32"],
                     "Lightning": [str(py), str(work / "lightning_mnist.py"), "32-true", *dev],
                     "Accelerate": [str(py), str(work / "accelerate_mnist.py"), "no", *dev]}}
    for row, commands in rows.items():
        if args.only and row != args.only:
            continue
        got = {name: [] for name in commands}
        for r in range(args.rounds):
            for name, cmd in commands.items():
                run_dir = work / f"{row}-{r}"
                wall, out = timed(cmd + (["--run-dir", str(run_dir)] if name == "brickyard" else []), env, work)
                if name == "brickyard":
                    s = json.loads((run_dir / "summary.json").read_text())
                    got[name].append((wall, s["train_seconds"], s["test_accuracy"], s["precision"]))
                else:
                    res = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
                    got[name].append((wall, res["loop_seconds"], res["test_accuracy"], "fp32"))
        print(f"\n{row} precision (median of {args.rounds}; ratio = brickyard / peer, paired by round)")
        print("| command | precision | whole command | training loop | test accuracy | brickyard / it: command, loop |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, runs in got.items():
            wall = statistics.median(x[0] for x in runs)
            loop = statistics.median(x[1] for x in runs)
            acc = ", ".join(f"{x[2]:.4f}" for x in runs)
            ratio = ""
            if name != "brickyard":
                rw = statistics.median(b[0] / x[0] for b, x in zip(got["brickyard"], runs))
                rl = statistics.median(b[1] / x[1] for b, x in zip(got["brickyard"], runs))
                ratio = f"{rw:.2f}x, {rl:.2f}x"
            print(f"| {name} | {runs[0][3]} | {wall:.2f} s | {loop:.2f} s | {acc} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
