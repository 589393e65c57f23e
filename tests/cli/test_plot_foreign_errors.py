"""``brickyard plot`` reads a run's ``test_errors.pt`` checked before use: a foreign one (a 3-D tensor, a short
``true``, float labels) is one sentence, and one of 200,000 errors draws the first 36 (it ran the host out of
memory, and the advice named the batch size)."""
import json

import pytest
import torch

from brickyard.errors import BrickyardError
from brickyard.files import write_torch
from brickyard.observe.plots import MOSAIC, _misclassified
from conftest import run_cli


def _errors(images, true, pred, classes=("0", "1")):
    return {"images": images, "true": true, "pred": pred, "classes": list(classes), "mean": [0.0], "std": [1.0]}


FINE = _errors(torch.zeros(3, 1, 28, 28, dtype=torch.uint8), torch.tensor([0, 1, 0]), torch.tensor([1, 0, 1]))


@pytest.mark.fast
@pytest.mark.parametrize("case, errors, said", [
    ("3-D", {**FINE, "images": torch.zeros(3, 28, 28)}, "holds images 3x28x28, 3 int64 true and 3 int64 pred labels"),
    ("short true", {**FINE, "true": torch.tensor([0])}, "holds images 3x1x28x28, 1 int64 true and 3 int64 pred labels"),
    ("float labels", {**FINE, "pred": torch.tensor([1.0, 0.0, 1.0])}, "3 int64 true and 3 float32 pred labels"),
    ("a list", {**FINE, "images": [[0]]}, "holds images list"),
    ("classes", {**FINE, "classes": "01"}, "a run writes N x C x H x W images and N integer labels of each"),
])
def test_a_foreign_test_errors_file_is_one_sentence(tmp_path, case, errors, said):
    write_torch(errors, tmp_path / "test_errors.pt")
    with pytest.raises(BrickyardError) as e:
        _misclassified(tmp_path / "test_errors.pt", tmp_path / "m.png")
    assert said in str(e.value) and "\n" not in str(e.value), (case, str(e.value))
    assert not (tmp_path / "m.png").exists()


@pytest.mark.fast
def test_many_or_large_errors_draw_the_first_36_at_a_bounded_size(tmp_path):
    from PIL import Image
    many = _errors(torch.zeros(200_000, 1, 4, 4, dtype=torch.uint8), torch.zeros(200_000, dtype=torch.long),
                   torch.ones(200_000, dtype=torch.long))
    write_torch(many, tmp_path / "many.pt")
    small = Image.open(_misclassified(tmp_path / "many.pt", tmp_path / "many.png")).size
    assert MOSAIC == 36 and small[1] < 36 / 6 * 120  # six rows of tiles, not 33,334
    big = _errors(torch.zeros(2, 3, 3000, 3000, dtype=torch.uint8), torch.tensor([0, 1]), torch.tensor([1, 0]))
    write_torch(big, tmp_path / "big.pt")
    assert max(Image.open(_misclassified(tmp_path / "big.pt", tmp_path / "big.png")).size) < 6 * 300


def test_plot_says_it_as_a_command(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0, "lr": 0.1}) + "\n")
    write_torch({**FINE, "images": torch.zeros(3, 28, 28)}, tmp_path / "test_errors.pt")
    r = run_cli("plot", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: test errors {tmp_path / 'test_errors.pt'} holds images 3x28x28, 3 int64 true and 3 int64 pred labels; "
        "a run writes N x C x H x W images and N integer labels of each."), r.stderr
