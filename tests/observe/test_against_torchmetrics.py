"""brickyard's scores against torchmetrics' (1.9) on the same predictions: top-1 and top-5 accuracy, the confusion
matrix, precision, recall and F1 (macro, weighted, per class), the calibration error, and for several labels an
image mean average precision (macro, micro) and F1 at a threshold. torchmetrics is a test dependency only
(docs/benchmarks.md: what it costs a run); fp32, in-process."""
import pytest
import torch

from brickyard.observe.metrics import EvalAccumulator
from brickyard.observe.multilabel import MultiLabelAccumulator

tm = pytest.importorskip("torchmetrics.classification")


def _single(seed, n=500, c=7, absent=None):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, c, (n,), generator=g)
    if absent is not None:  # a class no image has, and that nothing predicts: left out of the macro means
        y[y == absent] = (absent + 1) % c
    logits = 1.5 * torch.nn.functional.one_hot(y, c) + torch.randn(n, c, generator=g)
    if absent is not None:
        logits[:, absent] = -10
    return logits, y


@pytest.mark.fast
@pytest.mark.parametrize("absent", [None, 3])
def test_one_label_an_image_scores_equal_torchmetrics(absent):
    logits, y = _single(0, absent=absent)
    c = logits.shape[1]
    acc = EvalAccumulator(c, torch.device("cpu"))
    for a, b in zip(logits.split(64), y.split(64)):  # batches, as an evaluation adds them
        acc.update(a, b)
    r = acc.result()
    assert r["accuracy"] == pytest.approx(tm.MulticlassAccuracy(c, average="micro")(logits, y).item(), abs=1e-6)
    assert r["top5"] == pytest.approx(tm.MulticlassAccuracy(c, top_k=5, average="micro")(logits, y).item(), abs=1e-6)
    assert r["confusion"] == tm.MulticlassConfusionMatrix(c)(logits, y).tolist()
    for ours, avg in (("f1_macro", "macro"), ("f1_weighted", "weighted")):
        assert r[ours] == pytest.approx(tm.MulticlassF1Score(c, average=avg)(logits, y).item(), abs=1e-6)
    assert r["precision_macro"] == pytest.approx(tm.MulticlassPrecision(c, average="macro")(logits, y).item(), abs=1e-6)
    assert r["recall_macro"] == pytest.approx(tm.MulticlassRecall(c, average="macro")(logits, y).item(), abs=1e-6)
    assert r["f1"] == pytest.approx(tm.MulticlassF1Score(c, average="none")(logits, y).tolist(), abs=1e-6)
    ece = tm.MulticlassCalibrationError(c, n_bins=15, norm="l1")(logits.softmax(1), y).item()
    assert r["ece"] == pytest.approx(ece, abs=1e-6)


@pytest.mark.fast
def test_several_labels_an_image_score_equal_torchmetrics():
    g = torch.Generator().manual_seed(1)
    n, c = 400, 6
    targets = (torch.rand(n, c, generator=g) < 0.3).long()
    targets[:, 4] = 0  # a tag no image has: its AP counts 0 in the macro mean, in torchmetrics as in brickyard
    logits = 2.0 * targets - 1 + torch.randn(n, c, generator=g)
    acc = MultiLabelAccumulator(c, torch.device("cpu"), threshold=0.4)
    for a, b in zip(logits.split(50), targets.split(50)):
        acc.update(a, b)
    r = acc.result()
    scores = logits.sigmoid()
    with pytest.warns(UserWarning):  # torchmetrics says that tag 4 has no positive
        ap = tm.MultilabelAveragePrecision(c, average="macro")(scores, targets).item()
    assert r["map"] == pytest.approx(ap, abs=1e-6)
    micro = tm.MultilabelAveragePrecision(c, average="micro")(scores, targets).item()
    assert r["map_micro"] == pytest.approx(micro, abs=1e-6)
    f1 = tm.MultilabelF1Score(c, threshold=0.4, average="none")(scores, targets)
    assert r["f1"] == pytest.approx(f1.tolist(), abs=1e-6)
    assert r["f1_micro"] == pytest.approx(tm.MultilabelF1Score(c, threshold=0.4, average="micro")(scores, targets).item(), abs=1e-6)
    assert r["precision_micro"] == pytest.approx(tm.MultilabelPrecision(c, threshold=0.4, average="micro")(scores, targets).item(), abs=1e-6)
