"""The courses' recipes as presets: each states the course's recipe as the course's source writes it,
and each runs (a few steps here; the measured results are in docs/benchmarks.md)."""
import pytest

from brickyard.config import load_config
from brickyard.data import idx
from brickyard.data.export import export_idx
from brickyard.data.photos import make_photo_folder
from conftest import run_cli, sets

FASHION = idx.system_data() / "fashion-mnist"
needs_fashion = pytest.mark.skipif(not all(idx._find(FASHION, s) for s in idx.FILES),
                                   reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
QUICK = ["train.max_steps=2", "train.progress=none", "train.plots=false", "train.tensorboard=false",
         "train.threads=2", "train.precision=fp32"]


@pytest.mark.fast
def test_the_course_presets_state_the_courses_recipes():
    lenet = load_config("d2l-lenet")
    assert (lenet.model.name, lenet.model.init, lenet.optim.name, lenet.optim.lr, lenet.data.global_batch_size,
            lenet.train.epochs, lenet.data.name) == ("lenet", "normal:0.01", "sgd", 0.2, 256, 10, "fashion-mnist")
    resnet = load_config("d2l-resnet18")
    assert (resnet.model.name, resnet.model.init, resnet.optim.lr, resnet.schedule.name) == ("resnet18", "normal:0.01", 0.1, "constant")
    keras = load_config("keras-convnet")
    assert (keras.model.init, keras.optim.name, keras.optim.lr, keras.optim.eps, keras.data.global_batch_size) == \
        ("xavier", "adam", 0.001, 1e-7, 32)
    # d2l and the Keras tutorial train on all 60,000 training images and report test accuracy
    assert lenet.data.train_on_all and resnet.data.train_on_all and keras.data.train_on_all
    ft = load_config("d2l-finetune")
    # d2l's lr 5e-5 and weight decay 1e-3 act on a loss summed over the batch of 128: on the mean, x128 and /128
    assert ft.optim.lr == pytest.approx(5e-5 * 128) and ft.optim.weight_decay == pytest.approx(1e-3 / 128)
    assert (ft.finetune.head_lr_mult, ft.finetune.reset_head, ft.finetune.init_from, ft.train.epochs) == \
        (10, True, "torchvision:resnet18", 5)
    alex = load_config("d2l-alexnet")  # Fashion-MNIST resized to 224, read as an exported image folder
    assert (alex.model.name, alex.model.init, alex.optim.name, alex.optim.lr, alex.data.global_batch_size, alex.train.epochs,
            alex.data.train_transforms, alex.data.eval_transforms, alex.data.normalize, alex.dist.pipeline.stages) == \
        ("alexnet", "xavier", "sgd", 0.01, 128, 10, ("resize:224x224",), ("resize:224x224",), "none", 2)


@pytest.mark.fast
def test_the_lean_fashion_preset_is_the_recipe_its_table_measured():
    """docs/benchmarks.md's 20 seeds of `fashion-lean` ran as `fashion` with three overrides: the preset is that
    config, so a change to `fashion` that the table did not measure shows here."""
    lean = load_config("fashion-lean").to_dict()
    measured = load_config("fashion", ["model.name=fashion_lean", "data.random_erasing=0", "train.epochs=8"]).to_dict()
    assert {k: v for k, v in lean.items() if k != "preset"} == {k: v for k, v in measured.items() if k != "preset"}
    assert load_config("fashion").to_dict() != {**measured, "preset": "fashion"}  # the three overrides change it


@needs_fashion
@pytest.mark.parametrize("preset", ["d2l-lenet", "keras-convnet", "fashion", "fashion-lean", "fashion-long"])
def test_each_fashion_course_preset_runs(tmp_path, preset):
    # as shipped (fashion and fashion-long test 10 views of each image), on the first 500 test images: all 10,000
    # are half a minute with fashion-long's wide net
    r = run_cli("train", preset, *sets(*QUICK, "data.eval_limit=500"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "test accuracy:" in r.stdout and "on the first 500 test images" in r.stdout


@needs_fashion
def test_the_resnet_course_preset_trains_steps(tmp_path):
    """ResNet-18's evaluation of 20,000 images is minutes on 2 cores: its steps are timed by bench instead."""
    r = run_cli("bench", "d2l-resnet18", *sets("data.global_batch_size=8", "train.precision=fp32"), "--steps", "2",
                "--warmup", "1")
    assert r.returncode == 0, r.stderr
    assert "img/s" in r.stdout or "images/s" in r.stdout


@needs_fashion
def test_the_alexnet_preset_runs_in_two_stages_on_an_exported_fashion_mnist(tmp_path):
    """As its comment says to run it: Fashion-MNIST written as PNGs (2 of each class here), then 2 processes."""
    export_idx("fashion-mnist", tmp_path / "fashion", None, limit=2)
    r = run_cli("train", "d2l-alexnet", *sets(*QUICK, "train.threads=1", f"data.root={tmp_path / 'fashion'}",
                                               "data.global_batch_size=8", "data.num_workers=0"),
                "--devices", "cpu:2", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "pipeline:" in r.stdout and "test accuracy:" in r.stdout


def test_the_fine_tuning_preset_runs_on_an_image_folder(tmp_path):
    make_photo_folder(tmp_path / "photos", classes=2, per_class={"train": 4, "test": 2}, seed=1, min_size=240, max_size=300)
    r = run_cli("train", "d2l-finetune", *sets(*QUICK, f"data.root={tmp_path / 'photos'}", "finetune.init_from=null",
                                                "data.global_batch_size=4", "data.num_workers=0"),
                "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "new head fc: Linear(512 -> 2)" in r.stdout and "param group" in r.stdout
