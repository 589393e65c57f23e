"""brickyard's training throughput against a minimal hand-written loop.

Same model, batch, precision and in-memory data; the two are run interleaved (hand, brickyard,
hand, brickyard, ...) so drifts of the machine hit both, and the ratio of the median throughputs
is printed. Each brickyard round is a real `trainer.train` call on synthetic MNIST-shaped data;
its `images_per_second` is the training loop alone (no start-up, no evaluation).

    python benchmarks/overhead.py [--model mnist_fast] [--batch 128] [--steps 100] [--rounds 15] [--device cpu]
    python benchmarks/overhead.py --case resnet18     # ResNet-18 on 3x32x32, batch 128, 10 steps x 5 rounds
    python benchmarks/overhead.py --case resnet50     # ResNet-50 on 3x224x224, batch 16, 3 steps x 5 rounds

Many short rounds beat few long ones on a host whose speed drifts: each hand/brickyard pair runs
within seconds, and the median of the per-round ratios ignores the rounds a drift split.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from brickyard import models
from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.training import device as dev
from brickyard.training.loop import train

CASES = {"resnet18": dict(model="resnet18", image=(3, 32, 32), batch=128, steps=10, rounds=5),
         "resnet50": dict(model="resnet50", image=(3, 224, 224), batch=16, steps=3, rounds=5)}


def hand_loop(model_name, images, labels, batch, steps, device, precision, channels_last, lr=0.05):
    torch.manual_seed(0)
    model = models.create(model_name, 10, images.shape[1], tuple(images.shape[2:])).to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    images, labels = images.to(device), labels.to(device)
    mean, std = 0.5, 0.25
    n = len(labels)
    perm = torch.randperm(n, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        i = (step * batch) % (n - batch + 1)
        idx = perm[i:i + batch]
        x = (images[idx].float() / 255 - mean) / std
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with dev.autocast(device, precision):
            loss = F.cross_entropy(model(x).float(), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    loss.item()  # sync
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - start)


def brickyard_loop(model_name, batch, steps, device_name, n_train, image=(1, 28, 28), extra=()):
    cfg = load_config("mnist", [
        "data.name=synthetic", f"data.synthetic.num_train={n_train}", "data.synthetic.num_val=0",
        f"data.synthetic.channels={image[0]}", f"data.synthetic.height={image[1]}", f"data.synthetic.width={image[2]}",
        "data.synthetic.num_test=0", f"data.batch_size={batch}", f"model.name={model_name}",
        f"train.device={device_name}", "train.progress=none", f"train.max_steps={steps}", "train.epochs=1000",
        "train.log_every=100000", "checkpoint.every_epoch=false", "checkpoint.keep_best=false", "schedule.name=constant",
        # the hand loop's optimiser and loss (the default recipe's Adam and label smoothing would not be like for like)
        "optim.name=nesterov", "optim.lr=0.05", "optim.momentum=0.9", "optim.weight_decay=0.0005", "optim.label_smoothing=0",
        *extra,
    ])
    data = build_data(cfg.data)
    torch.manual_seed(0)
    model = models.create(model_name, 10, image[0], tuple(image[1:]))
    with tempfile.TemporaryDirectory() as d:
        return train(cfg, model, data, d, model_meta={"name": model_name})["images_per_second"], cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mnist_fast")
    p.add_argument("--batch", type=int, help="default 128, or the case's")
    p.add_argument("--steps", type=int, help="default 100, or the case's")
    p.add_argument("--rounds", type=int, help="default 15, or the case's")
    p.add_argument("--device", default="auto")
    p.add_argument("--image", default="1x28x28", help="C x H x W of the synthetic images")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config value for brickyard's side (repeatable), e.g. train.cuda_graphs=false")
    p.add_argument("--case", choices=sorted(CASES), help="a bigger model: sets --model and --image, and the defaults of "
                   "--batch, --steps and --rounds (sized for a CPU; give larger ones on a GPU)")
    a = p.parse_args(argv)
    image = tuple(int(v) for v in a.image.split("x"))
    c = CASES[a.case] if a.case else dict(batch=128, steps=100, rounds=15)
    if a.case:
        a.model, image = c["model"], c["image"]
    a.batch, a.steps, a.rounds = (a.batch or c["batch"]), (a.steps or c["steps"]), (a.rounds or c["rounds"])
    device = dev.resolve_device(a.device)
    if device.type == "cpu":
        dev.set_threads(0, 1)
        dev.tune_allocator()  # process-wide; brickyard's trainer does the same, so both loops get it from round 0
    precision = dev.resolve_precision("auto", device)
    channels_last = dev.resolve_channels_last("auto", precision, device)
    n_train = max(a.batch * a.steps, 4096 if image == (1, 28, 28) else a.batch * a.steps)
    data = build_data(load_config("mnist", ["data.name=synthetic", f"data.synthetic.num_train={n_train}",
                                            f"data.synthetic.channels={image[0]}", f"data.synthetic.height={image[1]}",
                                            f"data.synthetic.width={image[2]}"]).data)
    hand, ours = [], []
    for r in range(a.rounds):
        hand.append(hand_loop(a.model, data.train.images, data.train.labels, a.batch, a.steps, device, precision, channels_last))
        ours.append(brickyard_loop(a.model, a.batch, a.steps, str(device), n_train, image, a.set)[0])
        print(f"round {r}: hand {hand[-1]:,.0f} img/s, brickyard {ours[-1]:,.0f} img/s", flush=True)
    h, o = statistics.median(hand), statistics.median(ours)
    print(f"hardware: {dev.describe(device)}; torch {torch.__version__}")
    print(f"settings: model {a.model}{''.join(' --set ' + v for v in a.set)}, images {'x'.join(map(str, image))}, batch {a.batch}, {a.steps} steps x {a.rounds} rounds, precision {precision}, "
          f"channels_last {channels_last}, in-memory data")
    print(f"hand-written loop: median {h:,.0f} img/s (min {min(hand):,.0f}, max {max(hand):,.0f})")
    print(f"brickyard:         median {o:,.0f} img/s (min {min(ours):,.0f}, max {max(ours):,.0f})")
    paired = statistics.median(b / a for a, b in zip(hand, ours))
    print(f"ratio brickyard / hand-written: median of per-round ratios {paired:.3f}, ratio of medians {o / h:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
