"""The course recipe through brickyard against the course's own way.

The course's way: a Python generator that builds every batch of 100 from per-sample numpy arrays
(a list of 28x28 float arrays, stacked per batch), the course network, plain SGD lr 0.01, fp32.
brickyard: `brickyard train mnist-course`. Both run the same number of epochs on the same 50,000
training images; the script prints wall time per epoch, test accuracy and the speed-up.

    python benchmarks/course_recipe.py [--epochs 1]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from brickyard import models
from brickyard.api import train_config
from brickyard.config import load_config
from brickyard.data import build_data


def course_way(epochs: int, data) -> tuple[float, float]:
    torch.manual_seed(0)
    model = models.create("mnist_cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    samples = [(img[0].numpy().astype(np.float32) / 255.0 - 0.1307) / 0.3081 for img in data.train.images]
    labels = data.train.labels.numpy()

    def batches(batch_size=100):
        order = np.random.permutation(len(samples))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            x = np.stack([samples[j][None] for j in idx])
            y = np.array([labels[j] for j in idx])
            yield torch.from_numpy(x), torch.from_numpy(y).long()

    start = time.perf_counter()
    for _ in range(epochs):
        for x, y in batches():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        x = (data.test.images.float() / 255 - 0.1307) / 0.3081
        acc = sum((model(c).argmax(1) == t).sum().item() for c, t in zip(x.split(500), data.test.labels.split(500))) / len(x)
    return seconds, acc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    data = build_data(load_config("mnist-course").data)
    course_s, course_acc = course_way(a.epochs, data)
    print(f"course way: {course_s / a.epochs:.1f} s/epoch, test accuracy {course_acc:.4f}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        s = train_config(load_config("mnist-course", [f"train.epochs={a.epochs}", "train.progress=none", "train.device=cpu"]), d)
    print(f"brickyard:  {s['train_seconds'] / a.epochs:.1f} s/epoch, test accuracy {s['test_accuracy']:.4f}")
    print(f"speed-up: {course_s / s['train_seconds']:.2f}x (target >= 1.2x); epochs {a.epochs}; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")


if __name__ == "__main__":
    main()
