"""Small networks for 28 x 28 digits (any input size works; flatten sizes are computed)."""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from brickyard.models import register


def _pooled(size: int, *ops) -> int:
    """Spatial size after a chain of ("conv", k, pad) / ("pool", 2) operations."""
    for op in ops:
        size = size + 2 * op[2] - op[1] + 1 if op[0] == "conv" else size // op[1]
    return size


def _seq(**layers) -> nn.Sequential:
    """A Sequential with named layers, so inspection, watching and freezing can say conv1, fc."""
    return nn.Sequential(OrderedDict(layers))


@register("mnist_cnn", "course network: conv5x5x20-pool-conv5x5x20-pool-linear (980 -> 10 on 28x28)")
def mnist_cnn(num_classes=10, in_channels=1, image_size=(28, 28)):
    h, w = (_pooled(s, ("conv", 5, 2), ("pool", 2), ("conv", 5, 2), ("pool", 2)) for s in image_size)
    return _seq(
        conv1=nn.Conv2d(in_channels, 20, 5, padding=2), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(20, 20, 5, padding=2), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(), fc=nn.Linear(20 * h * w, num_classes),
    )


@register("mnist_fast", "the default net: conv5x5x16 stride 2, conv3x3x32-pool, conv3x3x64-pool, linear 576 -> classes")
def mnist_fast(num_classes=10, in_channels=1, image_size=(28, 28)):
    """Built for time to accuracy on CPUs: a stride-2 stem halves the image at once, the 3x3 convs do
    the work at 14 x 14 and 7 x 7, and max-pool comes before ReLU (the same function, a quarter of
    the ReLU work). No batch norm: on CPUs it costs more time than it saves steps at this size."""
    h, w = ((s + 1) // 2 // 2 // 2 for s in image_size)
    return _seq(
        conv1=nn.Conv2d(in_channels, 16, 5, stride=2, padding=2), relu1=nn.ReLU(),
        conv2=nn.Conv2d(16, 32, 3, padding=1), pool2=nn.MaxPool2d(2), relu2=nn.ReLU(),
        conv3=nn.Conv2d(32, 64, 3, padding=1), pool3=nn.MaxPool2d(2), relu3=nn.ReLU(),
        flatten=nn.Flatten(), fc=nn.Linear(64 * h * w, num_classes),
    )


@register("lenet", "LeNet variant: conv3x3x20-avgpool-conv5x5x50-avgpool-linear 800-128-classes")
def lenet(num_classes=10, in_channels=1, image_size=(28, 28)):
    h, w = (_pooled(s, ("conv", 3, 0), ("pool", 2), ("conv", 5, 0), ("pool", 2)) for s in image_size)
    return _seq(
        conv1=nn.Conv2d(in_channels, 20, 3), relu1=nn.ReLU(), pool1=nn.AvgPool2d(2),
        conv2=nn.Conv2d(20, 50, 5), relu2=nn.ReLU(), pool2=nn.AvgPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(50 * h * w, 128), relu3=nn.ReLU(), fc=nn.Linear(128, num_classes),
    )


@register("mlp", "two hidden layers of 256 units")
def mlp(num_classes=10, in_channels=1, image_size=(28, 28)):
    return _seq(
        flatten=nn.Flatten(), fc1=nn.Linear(in_channels * image_size[0] * image_size[1], 256), relu1=nn.ReLU(),
        fc2=nn.Linear(256, 256), relu2=nn.ReLU(), fc=nn.Linear(256, num_classes),
    )


@register("convnet", "conv32-pool-conv64-pool-conv64-dense64-classes (the Keras tutorial net)")
def convnet(num_classes=10, in_channels=1, image_size=(28, 28)):
    h, w = (_pooled(s, ("conv", 3, 0), ("pool", 2), ("conv", 3, 0), ("pool", 2), ("conv", 3, 0)) for s in image_size)
    return _seq(
        conv1=nn.Conv2d(in_channels, 32, 3), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(32, 64, 3), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        conv3=nn.Conv2d(64, 64, 3), relu3=nn.ReLU(),
        flatten=nn.Flatten(), fc1=nn.Linear(64 * h * w, 64), relu4=nn.ReLU(), fc=nn.Linear(64, num_classes),
    )


class FlattenHWC(nn.Module):
    """Flatten N x C x H x W to N x (H * W * C), channel fastest: a view of a channels-last map (nn.Flatten's
    C-first order copies it, forward and backward). The linear layer after it learns the same function."""

    def forward(self, x):
        return x.permute(0, 2, 3, 1).flatten(1)


def _pool_first(in_channels, widths, num_classes, image_size, last_pool: bool = True) -> nn.Sequential:
    """3x3 convolutions at 28, 14 and 7 px, each followed by max-pool, then batch norm and ReLU on the
    pooled map (a quarter of the normalisation work of batch norm before the pool). Without ``last_pool``
    the linear layer reads the last convolution's whole 7 x 7 map (flattened channels-last)."""
    pools = len(widths) if last_pool else len(widths) - 1
    h, w = image_size
    for _ in range(pools):
        h, w = h // 2, w // 2
    layers, c = {}, in_channels
    for i, width in enumerate(widths, 1):
        layers[f"conv{i}"] = nn.Conv2d(c, width, 3, padding=1, bias=False)
        if i <= pools:
            layers[f"pool{i}"] = nn.MaxPool2d(2)
        layers.update({f"bn{i}": nn.BatchNorm2d(width), f"relu{i}": nn.ReLU()})
        c = width
    flatten = nn.Flatten() if last_pool else FlattenHWC()
    return _seq(**layers, flatten=flatten, fc=nn.Linear(c * h * w, num_classes))


@register("fashion_fast", "conv3x3x16-pool, conv3x3x48-pool, conv3x3x128, each then batch norm and ReLU, linear 6272 -> classes")
def fashion_fast(num_classes=10, in_channels=1, image_size=(28, 28)):
    """Built for the fastest Fashion-MNIST on CPUs (docs/benchmarks.md): a full-resolution 3x3 stem (the
    clothes' fine detail matters more than the digits'), then 48 and 128 channels at 14 and 7 px (125k
    parameters, 63k of them in the linear layer, which reads all 7 x 7 positions of the last map, flattened
    channels-last as a view). Max-pool comes before batch norm and ReLU: 4,450 against 3,000 img/s with
    batch norm before the pool. Widths by measured speed and accuracy (batch 256, 2 cores of an Intel Xeon,
    fp32, channels-last, whole `brickyard train fashion` commands): 16-48-128 trains at about 6,500 img/s,
    16-48-160 at 5,900 for the same accuracy (10 epochs of the fashion recipe, seeds 0-19: mean 93.21%
    against 93.22%), 16-32-160 at 7,500 for 0.06 points less on three seeds; a 24- or 32-channel stem at
    4,200-4,600 (the pooled net). The convolutions run near the two cores' peak, so time a step follows
    arithmetic, most of it in the last convolution."""
    return _pool_first(in_channels, (16, 48, 128), num_classes, image_size, last_pool=False)


@register("fashion_lean", "conv3x3x16-pool, conv3x3x32-pool, conv3x3x64, each then batch norm and ReLU, linear 3136 -> classes: the fashion preset's net")
def fashion_lean(num_classes=10, in_channels=1, image_size=(28, 28)):
    """``fashion_fast``'s layout at 16-32-64 channels (55k parameters, 31k of them in the linear layer): the
    ``fashion-lean`` preset's net, for CPUs without AVX-512 or native bf16. A step of 256 takes about half
    the arithmetic and trains 1.7x as many images a second there (2 cores of an AMD EPYC with AVX2 only,
    fp32, whole `brickyard train` commands: 4,270-5,140 against 2,540-2,890 img/s); without random erasing
    it reaches 93.0% on every seed of 20 in 8 epochs (docs/benchmarks.md). 16-32-80 and 16-40-64 were no
    more accurate for their slower step, 16-24-64 less."""
    return _pool_first(in_channels, (16, 32, 64), num_classes, image_size, last_pool=False)


@register("fashion_wide", "conv3x3 at 32-128-256 channels, each then max-pool, batch norm and ReLU, linear 2304 -> classes: the longer Fashion-MNIST recipe's net")
def fashion_wide(num_classes=10, in_channels=1, image_size=(28, 28)):
    return _pool_first(in_channels, (32, 128, 256), num_classes, image_size)
