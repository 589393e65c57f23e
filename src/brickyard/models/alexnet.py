"""AlexNet as the d2l course builds it for Fashion-MNIST upsampled to 224 x 224 (d2l.ai 8.1, "Deep Convolutional
Neural Networks (AlexNet)"; d2l-ai/d2l-en, ``chapter_convolutional-modern/alexnet.md``, the PyTorch tab, read from a
copy of that file: the d2l-ai/d2l-en commits at hand were MXNet-only, whose first convolution has no padding, the same
54 x 54 map and 6400 features at 224 px).

The course's "slightly streamlined" AlexNet (Krizhevsky et al., 2012), one stream instead of the paper's two GPU
halves and without local response normalisation: conv 11x11/96 stride 4 padding 1, ReLU, max-pool 3/2; conv
5x5/256 padding 2, ReLU, max-pool 3/2; three 3x3 convolutions padding 1 (384, 384, 256 channels), each with a
ReLU; max-pool 3/2; flatten; linear 6400 -> 4096, ReLU, dropout 0.5; 4096 -> 4096, ReLU, dropout 0.5; 4096 ->
classes. At 224 px the last map is 256 x 5 x 5 (d2l's 6400); the flatten size follows the image size here, so
any image of at least ``MIN_SIDE`` pixels a side works (96 px: 256 x 1 x 1). d2l initialises the weights
Xavier-uniform in its training loop (``d2l.train_ch6``), not in the model: the ``d2l-alexnet`` preset's
``model.init: xavier``.
"""
from __future__ import annotations

from torch import nn

from brickyard.errors import ConfigError
from brickyard.models import register
from brickyard.models.small import _seq

MIN_SIDE = 65  # the smallest side whose last max-pool still has a pixel: 65 -> 15 -> 7 -> 3 -> 1


def last_side(side: int) -> int:
    """The side of the last max-pool's map for an image ``side`` pixels across; below 1: too small."""
    side = (side + 2 * 1 - 11) // 4 + 1  # conv 11x11, stride 4, padding 1
    for _ in range(3):  # max-pool 3/2 after conv1, conv2 and conv5; the 5x5 and 3x3 convolutions keep the size
        side = (side - 3) // 2 + 1
    return side


@register("alexnet", "d2l's AlexNet for Fashion-MNIST at 224 px: five convolutions (96-256-384-384-256), three max-pools, linear 6400-4096-4096-classes with dropout 0.5")
def alexnet(num_classes=10, in_channels=1, image_size=(224, 224)):
    h, w = (last_side(s) for s in image_size)
    if h < 1 or w < 1:
        raise ConfigError(f"model.name: alexnet reads images of at least {MIN_SIDE}x{MIN_SIDE} pixels (an 11x11 stride-4 "
                          f"convolution and three 3x3 stride-2 max-pools), not {image_size[0]}x{image_size[1]}; resize "
                          f"them (d2l's recipe: the d2l-alexnet preset, 224x224).")
    return _seq(
        conv1=nn.Conv2d(in_channels, 96, 11, stride=4, padding=1), relu1=nn.ReLU(), pool1=nn.MaxPool2d(3, 2),
        conv2=nn.Conv2d(96, 256, 5, padding=2), relu2=nn.ReLU(), pool2=nn.MaxPool2d(3, 2),
        conv3=nn.Conv2d(256, 384, 3, padding=1), relu3=nn.ReLU(),
        conv4=nn.Conv2d(384, 384, 3, padding=1), relu4=nn.ReLU(),
        conv5=nn.Conv2d(384, 256, 3, padding=1), relu5=nn.ReLU(), pool5=nn.MaxPool2d(3, 2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(256 * h * w, 4096), relu6=nn.ReLU(), dropout1=nn.Dropout(0.5),
        fc2=nn.Linear(4096, 4096), relu7=nn.ReLU(), dropout2=nn.Dropout(0.5),
        fc=nn.Linear(4096, num_classes),
    )
