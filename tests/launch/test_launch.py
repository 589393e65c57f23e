"""``brickyard.launch(fn, devices, args)``: one process per device from a plain script or a notebook-like
stdin session (functions in ``__main__``, nothing importable), rank 0's result back, a failing rank's
traceback back. fp32, one thread per process, a global batch that fixes the recipe."""
import subprocess
import sys
import textwrap

import pytest

from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS

CELL = textwrap.dedent("""
    import brickyard, torch

    CONFIG = {"train": {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                        "tensorboard": False, "epochs": 2, "seed": 3, "deterministic": True},
              "data": {"global_batch_size": 50}, "optim": {"name": "momentum", "lr": 0.05}}

    def points(n=500):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 2, generator=g)
        return x, (x[:, 0] * x[:, 1] > 0).long()

    def train(run_dir):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        return brickyard.fit(model, points(), config=CONFIG, run_dir=run_dir)

    def fails(word):
        import os
        if os.environ["RANK"] == "1":
            raise ValueError(f"rank 1 says {word}")
        return "fine"

    def drawn(run_dir):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        x, y = points()
        pairs = torch.utils.data.TensorDataset(x, y)
        sampler = torch.utils.data.WeightedRandomSampler((1 + 3 * y).double(), num_samples=300)
        loader = torch.utils.data.DataLoader(pairs, batch_size=17, sampler=sampler)  # 17 a device
        return brickyard.fit(model, loader, config={**CONFIG, "data": {}}, run_dir=run_dir)

    def collated(run_dir, batch):
        def pairs(items):  # items of a Python list of floats and an int
            return {"inputs": torch.tensor([x for x, _ in items]), "labels": torch.tensor([y for _, y in items])}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        x, y = points()
        items = list(zip(x.tolist(), y.tolist()))
        return brickyard.fit(model, torch.utils.data.DataLoader(items, batch_size=batch, collate_fn=pairs),
                             torch.utils.data.DataLoader(items[:120], batch_size=9, collate_fn=pairs),
                             config={**CONFIG, "data": {}}, run_dir=run_dir)
""")


def _python(code: str, cwd):
    """``code`` fed to ``python -`` on stdin: like a notebook cell, its functions live in a ``__main__``
    that no other interpreter could import."""
    return subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=cwd, timeout=300)


def test_launch_trains_on_two_processes_from_a_notebook_like_session_and_returns_rank_0s_result(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    r = _python(CELL + textwrap.dedent(f"""
        summary = brickyard.launch(train, devices="cpu:2", args=({str(two)!r},))
        print("WORLD", summary["world_size"], "STEPS", summary["steps"])
        print("ONE", train({str(one)!r})["world_size"])
    """), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "WORLD 2 STEPS 20" in r.stdout and "ONE 1" in r.stdout
    a = checkpoint.load(checkpoint.step_checkpoints(two / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(one / "checkpoints")[-1])["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < ACROSS_ORDERS  # the same weights: one job of two processes


def test_a_failing_rank_comes_back_with_its_traceback(tmp_path):
    r = _python(CELL + textwrap.dedent("""
        try:
            brickyard.launch(fails, devices="cpu:2", args=("no",))
        except brickyard.launch.processes.LaunchError as e:
            print("CAUGHT", str(e))
    """), tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "CAUGHT rank 1 failed: ValueError: rank 1 says no" in out
    assert "rank 1's traceback:" in out and 'File "<stdin>", line 21, in fails' in out  # the user's frame
    assert "Traceback" not in r.stderr  # torch's own dump of the same failure is not repeated


@pytest.mark.fast
def test_bad_devices_are_one_sentence(tmp_path):
    import pytest

    import brickyard
    from brickyard.errors import BrickyardError
    with pytest.raises(BrickyardError, match="expected cpu:N with N >= 1"):
        brickyard.launch(print, devices="cpu:0")
    with pytest.raises(BrickyardError, match="is not a function"):
        brickyard.launch(42, devices="cpu:2")


def test_a_weighted_sampler_draws_the_same_epochs_on_three_processes_as_on_one(tmp_path):
    """A DataLoader's WeightedRandomSampler on 3 processes (its batch of 17 a device) trains the weights that one
    process does with ``data.global_batch_size=51``: the epoch is drawn from the run's seed, the same on every
    rank, and sharded as brickyard shards a permutation."""
    three, one = tmp_path / "three", tmp_path / "one"
    r = _python(CELL + textwrap.dedent(f"""
        summary = brickyard.launch(drawn, devices="cpu:3", args=({str(three)!r},))
        print("WORLD", summary["world_size"], "STEPS", summary["steps"])
        CONFIG["data"] = {{"global_batch_size": 51}}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        x, y = points()
        sampler = torch.utils.data.WeightedRandomSampler((1 + 3 * y).double(), num_samples=300)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=51, sampler=sampler)
        print("ONE", brickyard.fit(model, loader, config=CONFIG, run_dir={str(one)!r})["steps"])
    """), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "WORLD 3 STEPS 12" in r.stdout and "ONE 12" in r.stdout  # 300 draws: 6 global batches of 51 an epoch
    a = checkpoint.load(checkpoint.step_checkpoints(three / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(one / "checkpoints")[-1])["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < ACROSS_ORDERS


def test_a_collate_fn_batches_each_ranks_share_on_three_processes_as_on_one(tmp_path):
    """A DataLoader's own collate_fn on 3 processes (its batch of 17 a device, a dict of inputs and labels from
    items of Python lists) trains the weights of one process with a batch of 51, and validates on the same."""
    three, one = tmp_path / "three", tmp_path / "one"
    r = _python(CELL + textwrap.dedent(f"""
        summary = brickyard.launch(collated, devices="cpu:3", args=({str(three)!r}, 17))
        print("WORLD", summary["world_size"], "STEPS", summary["steps"], "VAL", summary["val_accuracy"])
        print("ONE", collated({str(one)!r}, 51)["val_accuracy"])
    """), tmp_path)
    assert r.returncode == 0, r.stderr
    three_val, one_val = r.stdout.split("VAL ")[1].split()[0], r.stdout.split("ONE ")[1].split()[0]
    assert "WORLD 3 STEPS 20" in r.stdout and three_val == one_val != "None"  # 500 samples: 10 global batches an epoch
    a = checkpoint.load(checkpoint.step_checkpoints(three / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(one / "checkpoints")[-1])["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < ACROSS_ORDERS
