"""Precision, recall, F1 and balanced accuracy from the confusion matrix, against scikit-learn's on the same
predictions (scikit-learn here only: a test's reference, not a dependency)."""
import pytest
import torch
from sklearn import metrics as sklearn_metrics  # the test extra installs it

from brickyard.observe.metrics import EvalAccumulator, class_scores


def _scored(y: torch.Tensor, pred: torch.Tensor, classes: int) -> dict:
    acc = EvalAccumulator(classes, torch.device("cpu"))
    logits = torch.nn.functional.one_hot(pred, classes).float() * 5  # argmax: pred
    for part in range(0, len(y), 64):  # batch by batch, as an evaluation adds them
        acc.update(logits[part:part + 64], y[part:part + 64])
    return acc.result()


@pytest.mark.fast
@pytest.mark.parametrize("seed", range(4))
def test_scores_equal_scikit_learns_with_absent_and_never_predicted_classes(seed):
    g = torch.Generator().manual_seed(seed)
    classes = 7
    y = torch.randint(0, 5, (300,), generator=g)  # classes 5 and 6 are never true
    pred = torch.where(torch.rand(300, generator=g) < 0.6, y, torch.randint(0, 6, (300,), generator=g))  # 6: never predicted
    pred[pred == 3] = 2  # class 3 present, never predicted: its precision divides by zero (0, as scikit-learn)
    r = _scored(y, pred, classes)
    yt, yp = y.numpy(), pred.numpy()
    p, rc, f, s = sklearn_metrics.precision_recall_fscore_support(yt, yp, labels=list(range(classes)), zero_division=0)
    assert r["precision"] == pytest.approx(list(p)) and r["recall"] == pytest.approx(list(rc))
    assert r["f1"] == pytest.approx(list(f)) and r["support"] == list(s)
    for average in ("macro", "weighted"):  # over the labels present in the targets or the predictions, as its default
        p, rc, f, _ = sklearn_metrics.precision_recall_fscore_support(yt, yp, average=average, zero_division=0)
        if average == "macro":
            assert (r["precision_macro"], r["recall_macro"], r["f1_macro"]) == pytest.approx((p, rc, f))
        else:
            assert r["f1_weighted"] == pytest.approx(f)
    assert r["balanced_accuracy"] == pytest.approx(sklearn_metrics.balanced_accuracy_score(yt, yp))
    assert r["accuracy"] == pytest.approx(sklearn_metrics.accuracy_score(yt, yp))


@pytest.mark.fast
def test_a_perfect_and_an_empty_confusion_matrix():
    perfect = class_scores(torch.diag(torch.tensor([3, 4, 5])))
    assert all(perfect[k] == 1.0 for k in ("precision_macro", "recall_macro", "f1_macro", "f1_weighted", "balanced_accuracy"))
    empty = class_scores(torch.zeros(3, 3, dtype=torch.int64))
    assert empty["f1_macro"] == 0.0 and empty["balanced_accuracy"] == 0.0 and empty["support"] == [0, 0, 0]


def test_a_run_logs_the_scores_and_best_pt_and_early_stopping_watch_them(tmp_path):
    """An imbalanced 3-class problem (fp32, one thread): every validation row and the test row carry the scores,
    the summary the last validation's and the test's; ``checkpoint.monitor: val_f1_macro`` keeps the validation
    with the highest macro F1 (read against the rows), and EarlyStopping watches balanced accuracy."""
    import json

    from torch import nn

    from brickyard import api
    from brickyard.callbacks import EarlyStopping
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 2, generator=g)
    y = torch.where(x[:, 0] > 0.8, 2, torch.where(x[:, 1] > 1.0, 1, 0))  # about 70 / 15 / 15%
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 3))
    config = {"train": {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                        "tensorboard": False, "epochs": 8}, "data": {"batch_size": 32},
              "optim": {"name": "sgd", "lr": 0.05}, "checkpoint": {"monitor": "val_f1_macro"}}
    summary = api.fit(model, (x[:400], y[:400]), val_data=(x[400:500], y[400:500]), test_data=(x[500:], y[500:]),
                      config=config, run_dir=tmp_path / "r",
                      callbacks=[EarlyStopping("val_balanced_accuracy", patience=100)])
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["kind"] == "val"]
    assert len(val) == 8 and all(0 <= r[k] <= 1 for r in val for k in ("f1_macro", "balanced_accuracy", "f1_weighted"))
    assert len({r["f1_macro"] for r in val}) > 1  # it moves: the choice below is a choice
    best = max(val, key=lambda r: (r["f1_macro"], -r["step"]))
    assert torch.load(tmp_path / "r" / "checkpoints" / "best.pt", weights_only=True)["step"] == best["step"]
    test = next(r for r in rows if r["kind"] == "test")
    assert len(test["f1"]) == len(test["precision"]) == len(test["recall"]) == 3 and sum(test["support"]) == 100
    assert summary["test_f1_macro"] == test["f1_macro"] and summary["val_balanced_accuracy"] == val[-1]["balanced_accuracy"]
