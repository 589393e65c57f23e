"""VGG-16 with torchvision's layout and parameter names (``features.N``, ``classifier.N``)."""
from __future__ import annotations

from torch import nn

from brickyard.models import register

CFG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, num_classes=1000, in_channels=3, head="default"):
        super().__init__()
        layers, c = [], in_channels
        for v in CFG16:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        if head == "linear":  # one linear layer on the globally pooled 512 features
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(nn.Linear(512, num_classes))
            return
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)).flatten(1))

    def pipeline_pieces(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence of (name, module) whose composition is ``forward``: each convolution with its
        ReLU (named as the convolution, ``features.0``), each max-pool (``features.4``), then the head
        (``classifier``: avgpool, flatten, classifier); each piece holds this model's own parameters.

        A convolution and its ReLU stay together: the ReLU works in place, and a stage that began with it would write
        into the activation it received, a leaf that requires grad, which autograd refuses."""
        layers = list(self.features.named_children())
        out: list[tuple[str, nn.Module]] = []
        for i, (name, layer) in enumerate(layers):
            if isinstance(layer, nn.Conv2d):  # every convolution of CFG16 is followed by its ReLU
                out.append((f"features.{name}", nn.Sequential(layer, layers[i + 1][1])))
            elif isinstance(layer, nn.MaxPool2d):
                out.append((f"features.{name}", layer))
        return [*out, ("classifier", _Head(self))]


class _Head(nn.Module):
    def __init__(self, vgg: VGG):
        super().__init__()
        self.avgpool, self.classifier = vgg.avgpool, vgg.classifier

    def forward(self, x):
        return self.classifier(self.avgpool(x).flatten(1))  # as VGG.forward, after the features


@register("vgg16", "VGG-16, ImageNet layout (torchvision key names)")
def vgg16(num_classes=1000, in_channels=3, image_size=(224, 224), head="default"):
    return VGG(num_classes, in_channels, head)
