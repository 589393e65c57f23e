"""A DataLoader's sampler read into brickyard's batch plan: a ``SubsetRandomSampler``'s indices, a
``WeightedRandomSampler``'s draws, a ``DistributedSampler`` as the sharding brickyard does itself; and
``data.balance``, the class-balanced draw for the CLI. fp32, one thread, no loader workers, a global batch
that the 3-process plan does not divide."""
import re

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    Subset,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from brickyard import fit
from brickyard.callbacks import Callback
from brickyard.config import load_config
from brickyard.data.bundle import Draw, Split
from brickyard.data.loaders import BatchPlan, _PlanSampler, make_train_loader
from brickyard.errors import DataError
from conftest import run_cli

OV = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.plots=false", "train.tensorboard=false",
      "train.seed=3", "data.num_workers=0", "schedule.name=constant"]


class Seen(torch.utils.data.Dataset):
    """(input, label) pairs that remember which indices were read."""

    def __init__(self, x, y):
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.x[i], self.y[i]


class FromStart(Callback):
    """Forgets the reads made before training (fit's look at the first item)."""

    def __init__(self, ds):
        self.ds = ds

    def on_train_start(self, run):
        self.ds.read.clear()


def _data(n=120):
    torch.manual_seed(0)
    x = torch.randn(n, 1, 4, 4)
    return x, (x.flatten(1) @ torch.randn(16, 4)).argmax(1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))


@pytest.mark.fast
def test_a_weighted_draw_is_sharded_like_a_permutation_on_any_world_size():
    """Every rank of 1, 2 or 3 draws the same epoch from (seed, epoch); their shards, in rank order, are the
    one-process batch; zero weights are never drawn; another epoch draws again."""
    weights = torch.tensor([0.0, 1.0, 3.0] * 20, dtype=torch.double)
    draw = Draw(51, weights, replacement=True)  # a last global batch of 3: one sample a rank of 3
    one = [idx for idx, _ in BatchPlan(60, 16, seed=5, draw=draw).batches(0)]
    assert BatchPlan(60, 16, seed=5, draw=draw).steps_per_epoch == 4 and sum(map(len, one)) == 51
    for world in (2, 3):
        plans = [BatchPlan(60, 16 // world, world, r, seed=5, global_batch=16, draw=draw) for r in range(world)]
        shards = [list(p.batches(0)) for p in plans]
        for step, whole in enumerate(one):
            assert torch.equal(torch.cat([s[step][0] for s in shards]), whole)
    drawn = torch.cat(one)
    assert not (drawn % 3 == 0).any() and len(set(drawn.tolist())) < 51  # with replacement, by the weights
    assert not torch.equal(BatchPlan(60, 16, seed=5, draw=draw).permutation(1), drawn)
    without = BatchPlan(60, 16, seed=5, draw=Draw(130, None, replacement=False)).permutation(0)
    assert sorted(without[:60].tolist()) == list(range(60)) and len(without) == 130  # whole permutations, cut


@pytest.mark.fast
def test_a_subset_random_sampler_trains_on_its_indices_as_a_subset_would(tmp_path):
    """The train / validation split by indices over one Dataset (a common course idiom): the same weights and
    accuracy as fit on the two Subsets, and the validation loader reads its own indices only."""
    x, y = _data()
    ds = Seen(x, y)
    train_idx, val_idx = list(range(0, 120, 3)) + list(range(1, 120, 3)), list(range(2, 120, 3))
    ref = _model()
    s_ref = fit(ref, Subset(ds, train_idx), Subset(ds, val_idx), run_dir=tmp_path / "subset",
                overrides=OV + ["train.epochs=2", "data.batch_size=16", "data.eval_batch_size=10"])
    model = _model()
    s = fit(model, DataLoader(ds, batch_size=16, sampler=SubsetRandomSampler(train_idx)),
            DataLoader(ds, batch_size=10, sampler=SubsetRandomSampler(val_idx)), run_dir=tmp_path / "loader",
            overrides=OV + ["train.epochs=2"], callbacks=[FromStart(ds)])
    assert s["steps"] == s_ref["steps"] == 10 and s["val_accuracy"] == s_ref["val_accuracy"] is not None
    assert all(torch.equal(ref.state_dict()[k], model.state_dict()[k]) for k in ref.state_dict())
    assert set(ds.read) == set(range(120))  # training read its 80, validation its 40
    log = (tmp_path / "loader" / "train.log").read_text()
    assert "train_data: a DataLoader, read as its Dataset (the 80 samples of its SubsetRandomSampler) with its batch " \
           "of 16 per device (data.batch_size); brickyard shuffles and shards it" in log


@pytest.mark.fast
def test_a_weighted_random_sampler_draws_its_epoch_by_its_weights_and_resumes_exactly(tmp_path):
    """``num_samples`` a epoch, drawn by the weights (class 0 never), and the same weights whether the run
    goes on or stops after an epoch and resumes; a DistributedSampler trains as the plain Dataset does."""
    x, y = _data()
    ds = Seen(x, y)
    weights = (y != 0).double() * (1 + (y == 3).double())
    loader = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(weights, num_samples=64))
    model = _model()
    s = fit(model, loader, run_dir=tmp_path / "whole", overrides=OV + ["train.epochs=2"], callbacks=[FromStart(ds)])
    assert s["steps"] == 8 and len(ds.read) == 128 and not (y[ds.read] == 0).any()
    assert (y[ds.read] == 3).sum() > (y[ds.read] == 1).sum()
    assert "its WeightedRandomSampler: 64 samples an epoch, by its weights, with replacement" in \
        (tmp_path / "whole" / "train.log").read_text()
    first = ds.read[:64]
    part = _model()
    fit(part, loader, run_dir=tmp_path / "part", overrides=OV + ["train.epochs=2", "train.stop_epoch=1"])
    resumed = _model()
    s2 = fit(resumed, loader, run_dir=tmp_path / "part", resume="auto", overrides=OV + ["train.epochs=2"],
             callbacks=[FromStart(ds)])
    assert s2["steps"] == 8 and len(ds.read) == 64 and ds.read != first  # only the second epoch, drawn anew
    assert all(torch.equal(model.state_dict()[k], resumed.state_dict()[k]) for k in model.state_dict())
    plain, shared = _model(), _model()
    fit(plain, ds, run_dir=tmp_path / "plain", overrides=OV + ["train.epochs=1", "data.batch_size=16"])
    fit(shared, DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, num_replicas=2, rank=1)),
        run_dir=tmp_path / "distributed", overrides=OV + ["train.epochs=1"])
    assert all(torch.equal(plain.state_dict()[k], shared.state_dict()[k]) for k in plain.state_dict())


class Odd(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(1, self.n, 2))

    def __len__(self):
        return self.n // 2


@pytest.mark.parametrize("case", ["eval weighted", "short weights", "negative weight", "too many without replacement",
                                  "subset out of range", "own sampler", "huge epoch"])
@pytest.mark.fast
def test_a_sampler_brickyard_cannot_honour_is_one_sentence_and_makes_no_run(tmp_path, case):
    x, y = _data()
    ds = Seen(x, y)
    ones = torch.ones(120, dtype=torch.double)
    train, val, said = DataLoader(ds, batch_size=16), None, ""
    if case == "eval weighted":
        val = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(ones, 40))
        said = "val_data: the DataLoader draws samples at random (WeightedRandomSampler); an evaluation reads every sample once"
    elif case == "short weights":
        train = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(ones[:100], 40))
        said = ("train_data: the DataLoader's WeightedRandomSampler needs one finite weight of 0 or more for each of its "
                "Dataset's 120 samples, not all 0; it has 100.")
    elif case == "negative weight":
        train = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(-ones, 40))
        said = "train_data: the DataLoader's WeightedRandomSampler needs one finite weight of 0 or more for each of its " \
               "Dataset's 120 samples, not all 0; some are negative."
    elif case == "too many without replacement":
        w = ones.clone()
        w[10:] = 0
        train = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(w, 40, replacement=False))
        said = "draws 40 samples without replacement and only 10 have a weight above 0."
    elif case == "subset out of range":
        train = DataLoader(ds, batch_size=16, sampler=SubsetRandomSampler([0, 5, 120]))
        said = "train_data: the DataLoader's SubsetRandomSampler takes indices outside its Dataset's 0..119."
    elif case == "huge epoch":  # ran out of memory drawing the epoch, and said to try a smaller batch
        train = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(ones, 10**12))
        said = ("train_data: the DataLoader's WeightedRandomSampler draws 1,000,000,000,000 samples an epoch from 120; an "
                "epoch draws at most 100 times its Dataset's samples (12,000): train more epochs instead.")
    else:
        train = DataLoader(ds, batch_size=16, sampler=Odd(120))
        said = "train_data: the DataLoader samples with its own Odd; brickyard shuffles, shards and batches a Dataset itself"
    with pytest.raises(DataError, match=re.escape(said)):
        fit(_model(), train, val, run_dir=tmp_path / "r", overrides=OV)
    assert not (tmp_path / "r").exists() and not ds.read


@pytest.mark.fast
def test_a_random_sampler_with_replacement_draws_num_samples_an_epoch(tmp_path):
    x, y = _data()
    ds = Seen(x, y)
    s = fit(_model(), DataLoader(ds, batch_size=16, sampler=RandomSampler(ds, replacement=True, num_samples=40)),
            run_dir=tmp_path / "r", overrides=OV + ["train.epochs=1"], callbacks=[FromStart(ds)])
    assert s["steps"] == 3 and len(ds.read) == 40 and len(set(ds.read)) < 40


@pytest.mark.fast
def test_data_balance_draws_as_a_weighted_sampler_of_inverse_class_counts_does(tmp_path):
    """``data.balance`` on held tensors of a rare class: the same weights as a DataLoader whose
    WeightedRandomSampler weighs each sample 1 / its class's count (the usual hand-built balancing), and each
    class drawn about equally often. With a sampler of the loader's own, or a Dataset whose labels are not
    known up front, it is one sentence and no run directory."""
    from brickyard.config import load_config
    from brickyard.data import DataBundle, Split, balance
    x, y = _data()
    y = torch.where(torch.arange(120) < 100, y % 3, torch.full((120,), 3))  # class 3: about half the others' count
    ov = OV + ["train.epochs=2", "data.batch_size=16"]
    held = _model()
    s = fit(held, (x, y), run_dir=tmp_path / "balance", overrides=ov + ["data.balance=true"])
    counts = torch.bincount(y)
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16,
                        sampler=WeightedRandomSampler((1.0 / counts.double())[y], num_samples=120))
    by_hand = _model()
    s2 = fit(by_hand, loader, run_dir=tmp_path / "by-hand", overrides=OV + ["train.epochs=2"])
    assert s["steps"] == s2["steps"] == 16
    assert all(torch.equal(held.state_dict()[k], by_hand.state_dict()[k]) for k in held.state_dict())
    assert int(counts.min()) < int(counts.max()) // 2
    assert (f"data.balance: each epoch draws 120 training images with replacement, each of the 4 classes equally "
            f"likely (their images: {int(counts.min())} to {int(counts.max())})") in (tmp_path / "balance" / "train.log").read_text()
    bundle = DataBundle("t", Split(x, y), None, None, 4, 1, (4, 4))
    balance(bundle)
    drawn = y[torch.cat([i for i, _ in BatchPlan(120, 16, seed=0, draw=bundle.train.draw).batches(0)])]
    assert torch.bincount(drawn).min() >= 20  # class 3 drawn about as often as the others, 30 of 120 expected
    balance(bundle, False)  # the bundle given to a second run that does not balance
    assert bundle.train.draw is None
    assert load_config("mnist", ["data.balance=true"]).data.balance
    for train, said in ((loader, "data.balance draws the epoch by class and the DataLoader's sampler draws it too"),
                        (Seen(x, y), "data.balance needs the training labels up front (tensors or an image folder)")):
        with pytest.raises(DataError, match=re.escape(said)):
            fit(_model(), train, run_dir=tmp_path / "r", overrides=OV + ["data.balance=true"])
        assert not (tmp_path / "r").exists()


@pytest.mark.fast
def test_two_draws_of_one_image_get_two_seeds_for_their_random_transforms():
    """An image folder's crops and flips come from a seed per key; in a drawn epoch the key is the draw's place
    in the epoch, so the copies of an image are augmented differently, and still alike on any world size."""
    draw = Draw(40, torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.double))
    one = _PlanSampler(BatchPlan(4, 8, seed=1, draw=draw), seeded=True)
    keys = [k for batch in one for k in batch]
    assert len({i for i, _ in keys}) == 2 and len({seed for _, seed in keys}) == 40
    two = [_PlanSampler(BatchPlan(4, 4, 2, r, seed=1, global_batch=8, draw=draw), seeded=True) for r in range(2)]
    assert [k for b0, b1 in zip(*two) for k in b0 + b1] == keys
    base = (1 * 1_000_003 + 0) * 0x9E3779B1  # a permutation's epoch keeps its keys: an image's seed, as before
    assert all(seed == (base + i) % (1 << 62) for batch in _PlanSampler(BatchPlan(4, 2, seed=1), seeded=True)
               for i, seed in batch)


def test_data_balance_on_an_image_folder_from_the_cli(tmp_path):
    from brickyard.data.photos import make_photo_folder
    root = tmp_path / "photos"
    make_photo_folder(root, classes=3, per_class={"train": 6, "val": 2, "test": 2}, seed=5, min_size=40, max_size=60)
    rare = sorted((root / "train").iterdir())[2]
    for f in sorted(rare.iterdir())[1:]:
        f.unlink()  # the third class: 1 training photo against 6 and 6
    r = run_cli("train", "--set", "data.name=imagefolder", "--set", f"data.root={root}", "--set", "data.balance=true",
                "--set", "data.train_transforms=[random_resized_crop:32, hflip]", "--set", "data.eval_transforms=[resize:32x32]",
                "--set", "model.name=mnist_cnn", "--set", "train.epochs=2", "--set", "data.batch_size=4",
                "--set", "train.progress=none", "--set", "train.precision=fp32", "--set", "data.num_workers=0",
                "--set", "train.plots=false", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    assert "data.balance: each epoch draws 13 training images with replacement, each of the 3 classes equally likely " \
           "(their images: 1 to 6)" in log


@pytest.mark.fast
def test_a_loaders_drop_last_leaves_out_the_last_partial_global_batch(tmp_path):
    """``DataLoader(drop_last=True)`` sets ``data.drop_last``: each epoch is its full global batches only, on any
    number of ranks, with the weights of the Dataset and that key; an evaluation loader's drop_last is said and
    not applied (every sample is scored). Before, it was dropped silently and the last partial batch trained."""
    for world in (1, 3):
        kept = [BatchPlan(100, 30 // world, world, r, seed=1, global_batch=30) for r in range(world)]
        dropped = [BatchPlan(100, 30 // world, world, r, seed=1, global_batch=30, drop_last=True) for r in range(world)]
        assert kept[0].steps_per_epoch == 4 and dropped[0].steps_per_epoch == 3
        for a, b in zip(kept, dropped):
            assert [torch.equal(x, y) for (x, _), (y, _) in zip(a.batches(0), b.batches(0))] == [True] * 3
    with pytest.raises(DataError, match="data.drop_last leaves out an epoch's last partial global batch, and an epoch "
                                        "of 20 samples is shorter than the global batch of 30"):
        BatchPlan(20, 30, seed=1, drop_last=True)
    x, y = _data()
    cfg = load_config(None, ["data.drop_last=true", "data.batch_size=16", "data.global_batch_size=0"]).data
    assert make_train_loader(Split(x, y), cfg, torch.device("cpu"), 1, 0, 0).plan.steps_per_epoch == 7  # as train plans
    ds = Seen(x, y)
    model = _model()
    s = fit(model, DataLoader(ds, batch_size=16, shuffle=True, drop_last=True),
            DataLoader(Subset(ds, range(50)), batch_size=15, drop_last=True), run_dir=tmp_path / "loader",
            overrides=OV + ["train.epochs=2"])
    assert s["steps"] == 14  # 120 samples: 7 full batches of 16 an epoch (8 with the last 8 samples)
    log = (tmp_path / "loader" / "train.log").read_text()
    assert "with its batch of 16 per device (data.batch_size), its last partial batch left out (data.drop_last); " in log
    assert "val_data: a DataLoader, read as its Dataset with its batch of 15 (data.eval_batch_size); its drop_last is not " \
           "applied: an evaluation reads every sample once" in log
    plain = _model()
    s2 = fit(plain, ds, Subset(ds, range(50)), run_dir=tmp_path / "dataset",
             overrides=OV + ["train.epochs=2", "data.batch_size=16", "data.eval_batch_size=15", "data.drop_last=true"])
    assert s2["steps"] == 14 and s2["val_accuracy"] == s["val_accuracy"]
    assert all(torch.equal(model.state_dict()[k], plain.state_dict()[k]) for k in model.state_dict())
