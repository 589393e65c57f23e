"""brickyard's own optimisers: the updates of torch.optim's, their checkpoints, and no torch._dynamo."""
import copy
import subprocess
import sys

import pytest
import torch

from brickyard.optim import SGD, Adam
from conftest import SYNTH, sets

# (torch.optim's, brickyard's) for each kind the config names; fp32 on the CPU, one thread
KINDS = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-3),
            lambda p: SGD([{"params": p}], lr=0.1, weight_decay=1e-3)),
    "momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda p: SGD([{"params": p}], lr=0.1, momentum=0.9)),
    "nesterov": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4),
                 lambda p: SGD([{"params": p}], lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)),
    "adam": (lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.7, 0.9), weight_decay=1e-3),
             lambda p: Adam([{"params": p}], lr=0.01, betas=(0.7, 0.9), weight_decay=1e-3)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
              lambda p: Adam([{"params": p}], lr=0.01, weight_decay=0.1, decoupled=True)),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.fast
def test_same_updates_as_torch_optim(kind):
    theirs, ours = KINDS[kind]
    a, b = _model(), _model()
    opt_a, opt_b = theirs(a.parameters()), ours(b.parameters())
    _train(a, opt_a, 30)
    _train(b, opt_b, 30)
    assert _max_diff(a, b) < 1e-6
    assert sorted(opt_a.state_dict()["state"].get(0, {})) == sorted(opt_b.state_dict()["state"].get(0, {}))


@pytest.mark.parametrize("kind", ["nesterov", "adam"])
@pytest.mark.fast
def test_resumes_from_a_torch_optim_checkpoint_and_from_its_own(kind):
    """A checkpoint of torch.optim's optimiser (written by earlier brickyard versions) and one of ours,
    each loaded into a fresh optimiser, continue exactly as the uninterrupted run."""
    theirs, ours = KINDS[kind]
    straight = _model()
    opt = ours(straight.parameters())
    _train(straight, opt, 10)
    _train(straight, opt, 10, seed=2)
    for first in (theirs, ours):
        half = _model()
        opt_half = first(half.parameters())
        _train(half, opt_half, 10)
        saved = copy.deepcopy({"model": half.state_dict(), "optimizer": opt_half.state_dict()})
        resumed = _model()
        resumed.load_state_dict(saved["model"])
        opt_resumed = ours(resumed.parameters())
        opt_resumed.load_state_dict(saved["optimizer"])
        _train(resumed, opt_resumed, 10, seed=2)
        assert _max_diff(straight, resumed) < 1e-6


@pytest.mark.fast
def test_a_checkpoint_of_other_parameter_groups_is_refused():
    opt = Adam([{"params": list(_model().parameters())}], lr=0.01)
    other = Adam([{"params": list(_model().parameters())[:2]}], lr=0.01)
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(other.state_dict())


def test_training_never_imports_dynamo(tmp_path):
    """torch.optim's optimisers and torch.use_deterministic_algorithms import torch._dynamo (about
    1 s of every command on a 2-core CPU); the default optimiser and a run's ends must not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nfrom brickyard.cli import main\n"
        f"main(['train', '--run-dir', {str(tmp_path / 'run')!r}, "
        + ", ".join(repr(a) for a in sets(*SYNTH, "optim.name=adam", "train.epochs=1", "train.plots=false")) + "])\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dynamo imported: False" in r.stdout


@pytest.mark.parametrize("kind", ["nesterov", "adam"])
@pytest.mark.fast
def test_a_group_added_later_trains_as_torch_optims_does(kind):
    """A callback that unfreezes layers adds a parameter group mid-run (the torch.optim call)."""
    theirs, ours = KINDS[kind]
    runs = []
    for make in (theirs, ours):
        model = _model()
        head, body = list(model[2].parameters()), list(model[0].parameters())
        opt = make(head)
        _train(model, opt, 5)
        opt.add_param_group({"params": body, "lr": 0.003})
        _train(model, opt, 5, seed=2)
        assert opt.state[body[0]]  # the added group has state after its first step
        runs.append(model)
    assert _max_diff(*runs) < 1e-6
