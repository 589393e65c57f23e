import pytest
import torch

from brickyard import models
from brickyard.errors import ConfigError

# the models whose step takes seconds on a CPU core (vit_small 9 s, vgg16 8 s, resnet50 6 s) stay out of the fast tier
SLOW_STEP = ("resnet18", "resnet18_imagenet", "resnet50", "vgg16", "vit_tiny", "vit_small")


@pytest.mark.parametrize("name", [n if n in SLOW_STEP else pytest.param(n, marks=pytest.mark.fast) for n in models.names()])
def test_every_registered_model_trains_one_step(name):
    big = name in ("resnet50", "vgg16", "resnet18_imagenet")
    size = (32, 32) if big or name == "resnet18" else (65, 65) if name == "alexnet" else (28, 28)  # alexnet: its smallest
    channels = 3 if size == (32, 32) else 1
    torch.manual_seed(0)
    model = models.create(name, num_classes=7, in_channels=channels, image_size=size)
    x, y = torch.randn(4, channels, *size), torch.randint(0, 7, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    out = model(x)
    assert out.shape == (4, 7)
    torch.nn.functional.cross_entropy(out, y).backward()
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.fast
def test_course_network_layout():
    m = models.create("mnist_cnn")
    convs = [l for l in m if isinstance(l, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [(1, 20, (5, 5), (2, 2)), (20, 20, (5, 5), (2, 2))]
    assert m[-1].in_features == 980 and m[-1].out_features == 10
    assert models.create("lenet").fc1.in_features == 800
    assert [n for n, _ in m.named_children()] == ["conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten", "fc"]


@pytest.mark.fast
def test_the_fashion_net_reads_its_last_map_whole_without_a_copy():
    """fashion_fast's linear layer reads all 7 x 7 x 128 positions; the flatten is a view of a channels-last
    map (nn.Flatten copies it), and holds the same values as nn.Flatten's in another order."""
    m = models.create("fashion_fast")
    assert [n for n, _ in m.named_children()][-6:] == ["relu2", "conv3", "bn3", "relu3", "flatten", "fc"] and m.fc.in_features == 6272
    x = torch.randn(3, 128, 7, 7).contiguous(memory_format=torch.channels_last)
    flat = m.flatten(x)
    assert flat.shape == (3, 6272) and flat.data_ptr() == x.data_ptr() and flat.is_contiguous()
    assert torch.equal(flat.sort(1).values, torch.nn.Flatten()(x).sort(1).values)
    assert models.create("fashion_fast", image_size=(32, 32)).fc.in_features == 128 * 8 * 8
    assert sum(p.numel() for p in m.parameters()) == 125_466


def test_torchvision_key_names():
    keys = set(models.create("resnet50", 1000, 3, (224, 224)).state_dict())
    assert {"conv1.weight", "bn1.running_mean", "layer4.2.conv3.weight", "fc.bias", "layer1.0.downsample.0.weight"} <= keys
    assert {"features.0.weight", "classifier.6.bias"} <= set(models.create("vgg16", 1000, 3, (224, 224)).state_dict())


@pytest.mark.fast
def test_unknown_model():
    with pytest.raises(ConfigError, match="model.name: 'resnet7' is not one of"):
        models.create("resnet7")
