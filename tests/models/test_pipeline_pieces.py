"""The registry models as pipeline pieces (``pipeline_pieces()``, or an ``nn.Sequential``'s children): their
composition is the model's forward bit for bit, each piece holds the model's own parameters and is named as one of
its modules, and two stages cut from them compute the same; AlexNet as d2l builds it. CPU, fp32, small images."""
import functools
from collections import Counter

import pytest
import torch
from torch import nn

from brickyard import models
from brickyard.distributed import pipeline
from brickyard.errors import ConfigError

# (registry name, options, channels, side): each model at about the smallest image it reads (resnet50's layer4 and
# vgg16's last pool at 1 x 1, alexnet's last pool at 1 x 1 from 65 px), so that a test takes a fraction of a second;
# vgg16's default head pools any map to 7 x 7 (building its 4096-unit classifier is most of its time)
CASES = {
    "resnet18": ("resnet18", {"drop_path": 0.1}, 3, 32),
    "resnet50": ("resnet50", {"drop_path": 0.1}, 3, 32),
    "vgg16-linear": ("vgg16", {"head": "linear"}, 3, 32),
    "vgg16": ("vgg16", {}, 3, 32),
    "alexnet": ("alexnet", {}, 1, 67),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Two OpenMP threads spin-wait on a loaded 2-core machine: a small convolution took 30 ms against 0.5 ms."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@functools.cache  # built once for the tests of this module: none changes a parameter
def _model_and_input(case: str) -> tuple[nn.Module, torch.Tensor]:
    name, options, channels, side = CASES[case]
    torch.manual_seed(0)
    return models.create(name, 10, channels, (side, side), **options), torch.randn(2, channels, side, side)


def _composed(modules, x: torch.Tensor) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x


@pytest.mark.fast
@pytest.mark.parametrize("case", list(CASES))
def test_the_pieces_compose_to_the_models_forward(case):
    """In evaluation, and in training with the same random draws (drop path, dropout) and batch statistics."""
    model, x = _model_and_input(case)
    parts = [m for _, m in pipeline.pieces(model)]
    with torch.no_grad():
        whole = model.eval()(x)
        assert torch.equal(_composed(parts, x), whole)
        model.train()
        torch.manual_seed(1)
        whole = model(x)
        torch.manual_seed(1)
        assert torch.equal(_composed(parts, x), whole)


@pytest.mark.fast
@pytest.mark.parametrize("case", list(CASES))
def test_each_parameter_and_buffer_is_held_by_one_piece_named_as_a_module(case):
    model, _ = _model_and_input(case)
    parts = pipeline.pieces(model)
    held = Counter(id(t) for _, m in parts for t in [*m.parameters(), *m.buffers()])
    own = [*model.parameters(), *model.buffers()]
    assert set(held) == {id(t) for t in own} and set(held.values()) == {1}
    names = [n for n, _ in parts]
    assert len(set(names)) == len(names) and set(names) <= set(dict(model.named_modules()))


@pytest.mark.fast
def test_the_resnet_and_vgg_pieces():
    """ResNet: the stem, each residual block, the head. VGG: each convolution with its in-place ReLU (a stage that
    began with the ReLU would write into the activation it received), each max-pool, the head."""
    resnet, _ = _model_and_input("resnet18")
    assert [n for n, _ in pipeline.pieces(resnet)] == [
        "conv1", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1", "fc"]
    vgg, _ = _model_and_input("vgg16-linear")
    parts = pipeline.pieces(vgg)
    assert len(parts) == 13 + 5 + 1 and parts[-1][0] == "classifier"
    assert [n for n, m in parts if isinstance(m, nn.MaxPool2d)] == [f"features.{i}" for i in (4, 9, 16, 23, 30)]
    assert all([type(c) for c in m] == [nn.Conv2d, nn.ReLU] for _, m in parts if isinstance(m, nn.Sequential))


@pytest.mark.fast
@pytest.mark.parametrize("case", list(CASES))
def test_two_stages_compose_to_the_models_forward(case):
    model, x = _model_and_input(case)
    starts = pipeline.cuts(model, 2)
    assert len(starts) == 2 and starts[0] == 0
    stages = [pipeline.stage_module(model, starts, i) for i in range(2)]
    held = [m for s in stages for m in s if m.__class__.__name__ not in ("_Copy", "_Dense")]  # no parameters
    parts = pipeline.pieces(model)  # every piece once, in order (wrappers are made anew: compare what they hold)
    assert len(held) == len(parts) and [id(q) for m in held for q in m.parameters()] == \
        [id(q) for _, m in parts for q in m.parameters()]
    with torch.no_grad():
        whole = model.eval()(x)
        assert torch.equal(_composed(stages, x), whole)


@pytest.mark.fast
def test_alexnet_is_d2ls_for_fashion_mnist_at_224():
    torch.manual_seed(0)
    model = models.create("alexnet", 10, 1, (224, 224))
    # conv1 96 x 1 x 11 x 11 + 96 = 11,712; conv2 256 x 96 x 5 x 5 + 256 = 614,656; conv3 384 x 256 x 3 x 3 + 384 =
    # 885,120; conv4 384 x 384 x 9 + 384 = 1,327,488; conv5 256 x 384 x 9 + 256 = 884,992; fc1 6400 x 4096 + 4096 =
    # 26,218,496 (224 -> conv1 54 -> pool 26 -> pool 12 -> pool 5: 256 x 5 x 5 = 6400); fc2 4096 x 4096 + 4096 =
    # 16,781,312; fc 4096 x 10 + 10 = 40,970. Total 46,764,746
    assert models.count_parameters(model) == 46_764_746
    assert model.fc1.in_features == 6400
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 1, 224, 224)).shape == (2, 10)
    assert [n for n, _ in model.named_children()] == [
        "conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "conv3", "relu3", "conv4", "relu4", "conv5", "relu5",
        "pool5", "flatten", "fc1", "relu6", "dropout1", "fc2", "relu7", "dropout2", "fc"]


@pytest.mark.fast
def test_alexnet_reads_images_down_to_65_px_and_says_so_below():
    assert models.create("alexnet", 10, 3, (65, 80)).fc1.in_features == 256
    with pytest.raises(ConfigError, match="^model.name: alexnet reads images of at least 65x65 pixels .* not 64x64; "):
        models.create("alexnet", 10, 1, (64, 64))
    with pytest.raises(ConfigError, match="not 28x28"):
        models.create("alexnet", 10, 1, (28, 28))
