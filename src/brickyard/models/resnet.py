"""ResNets with torchvision's parameter names, so its ImageNet state_dicts load unchanged.

``resnet18`` is the small-image variant (3x3 stem, stride 1, no max-pool); ``resnet18_imagenet``
and ``resnet50`` keep the standard 7x7 stride-2 stem and max-pool.
"""
from __future__ import annotations

from torch import nn

from brickyard.models import register
from brickyard.models.droppath import branch, rates


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, drop_path=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.drop_path = drop_path or nn.Identity()

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.drop_path(self.bn2(self.conv2(out))) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, drop_path=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path = drop_path or nn.Identity()

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.drop_path(self.bn3(self.conv3(out))) + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000, in_channels=3, small_input=False, drop_path=0.0):
        super().__init__()
        self.inplanes = 64
        self._rates = iter(rates(drop_path, sum(layers)))
        self._index = 0
        if small_input:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._layer(block, 64, layers[0], 1)
        self.layer2 = self._layer(block, 128, layers[1], 2)
        self.layer3 = self._layer(block, 256, layers[2], 2)
        self.layer4 = self._layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        del self._rates, self._index
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _layer(self, block, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, self._branch())]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, drop_path=self._branch()) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def _branch(self):
        self._index += 1
        return branch(next(self._rates), self._index)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))

    def pipeline_pieces(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence of (name, module) whose composition is ``forward``: the stem (``conv1``: conv1,
        bn1, relu, maxpool), each residual block (``layer1.0`` ... ``layer4.N``), the head (``fc``: avgpool,
        flatten, fc); each piece holds this model's own parameters (the pieces a pipeline's stages are cut from)."""
        blocks = [(f"{layer}.{i}", b) for layer in ("layer1", "layer2", "layer3", "layer4")
                  for i, b in enumerate(getattr(self, layer))]
        return [("conv1", _Stem(self)), *blocks, ("fc", _Head(self))]


class _Stem(nn.Module):
    def __init__(self, resnet: ResNet):
        super().__init__()
        self.conv1, self.bn1, self.relu, self.maxpool = resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool

    def forward(self, x):
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))  # as ResNet.forward's first line


class _Head(nn.Module):
    def __init__(self, resnet: ResNet):
        super().__init__()
        self.avgpool, self.fc = resnet.avgpool, resnet.fc

    def forward(self, x):
        return self.fc(self.avgpool(x).flatten(1))  # as ResNet.forward's last line


@register("resnet18", "ResNet-18 for small images (3x3 stem, stride 1, no max-pool)")
def resnet18(num_classes=10, in_channels=3, image_size=(32, 32), drop_path=0.0):
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels, small_input=True, drop_path=drop_path)


@register("resnet18_imagenet", "ResNet-18, ImageNet layout (torchvision key names)")
def resnet18_imagenet(num_classes=1000, in_channels=3, image_size=(224, 224), drop_path=0.0):
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels, drop_path=drop_path)


@register("resnet50", "ResNet-50, ImageNet layout (torchvision key names)")
def resnet50(num_classes=1000, in_channels=3, image_size=(224, 224), drop_path=0.0):
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_channels, drop_path=drop_path)
