"""Evaluation of a split, and the end of a run: the test pass, ``summary.json`` and the plots."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from brickyard.data import Split
from brickyard.data.loaders import eval_batches, eval_count
from brickyard.distributed import fsdp
from brickyard.distributed.process import all_reduce_sum
from brickyard.errors import BrickyardError
from brickyard.files import write_json, write_torch
from brickyard.observe.calibration import fit_temperature
from brickyard.observe.loggers import QUOTED
from brickyard.observe.metrics import EvalAccumulator, class_targets
from brickyard.observe.multilabel import MultiLabelAccumulator
from brickyard.observe.plots import plot_runs
from brickyard.training import device as dev


def evaluate(model: nn.Module, split: Split, prep, device: torch.device, precision: str, batch_size: int,
             num_classes: int, world: int = 1, rank: int = 0, group=None, keep_errors: int = 0,
             num_workers: int = 0, loss_sum=None, lockstep: bool = False, tta: str = "none", shift: int = 1,
             limit: int = 0, temperature: float = 1.0, keep: list | None = None, multilabel: bool = False,
             threshold: float | None = 0.5) -> dict:
    """Loss, top-1/top-5 accuracy, per-class accuracy and confusion over every sample of ``split``
    exactly once, summed across ranks. ``keep_errors``: also return up to that many of this
    rank's misclassified raw images with true and predicted labels (host syncs; test time only).
    ``lockstep``: every rank runs as many forward passes as the rank with the largest share (FSDP's
    forward is a collective); the extra ones, on a batch already counted, are not counted again.
    ``tta``: test-time augmentation (``data.tta``): ``flip`` scores each image by the mean of its own and
    its mirror image's class probabilities; ``flip-shift`` adds both moved by ``shift`` pixels up, down,
    left and right (10 views, zeros filled in as the training shifts do). ``limit``: the first that many
    samples of ``split`` only (``data.eval_limit``; 0: all). ``temperature`` and ``keep``: temperature scaling's
    divisor of the logits, and a list this rank's raw logits are kept in (``EvalAccumulator``). ``multilabel``: several
    labels an image, scored at ``threshold`` (None: the best on this split; ``observe.multilabel``)."""
    def forward(x):
        return model(prep(x)) if tta == "none" else tta_logits(model, prep(x), tta, shift)

    was_training = model.training
    model.eval()
    acc = (MultiLabelAccumulator(num_classes, device, loss_sum, threshold) if multilabel
           else EvalAccumulator(num_classes, device, loss_sum, temperature, keep))
    errors, kept, done, x = [], 0, 0, None
    with torch.no_grad(), dev.autocast(device, precision):
        for x, y in eval_batches(split, batch_size, device, world, rank, num_workers, limit):
            pred = acc.update(forward(x), y)
            done += 1
            if pred is not None and kept < keep_errors:
                y = class_targets(y)
                wrong = (pred != y).nonzero().flatten()[:keep_errors - kept]
                errors.append((x[wrong].cpu(), y[wrong].cpu(), pred[wrong].cpu()))
                kept += len(wrong)
        most = math.ceil(math.ceil(eval_count(split, limit) / world) / batch_size)  # the largest share is rank 0's
        if lockstep and done < most:
            spare = x if x is not None else next(eval_batches(split, 1, device))[0]
            for _ in range(done, most):
                forward(spare)
    model.train(was_training)
    result = acc.result(group)
    if keep_errors and kept:  # a split scored without a mistake has none to keep (and no empty file to plot)
        result["errors"] = tuple(torch.cat(parts) for parts in zip(*errors))
    return result


CROP = 0.875  # five-crop's side, of the image's: 224 of 256, as ImageNet's evaluation crops
SCALES = (0.875, 1.0, 1.125)  # multi-scale's sizes, of the image's


def tta_logits(model: nn.Module, x: torch.Tensor, tta: str, shift: int = 1) -> torch.Tensor:
    """Log of the mean class probabilities over the views of a prepared batch ``x`` (so argmax and
    cross-entropy read them as logits).

    The CIFAR-10 speed record's test-time augmentation (KellerJordan/cifar10-airbench, ``airbench94.py``
    at 01a2367: ``infer_mirror`` and ``infer_mirror_translate`` in ``main``'s "TTA Evaluation" block)
    averages *logits* of the image and its mirror, then gives half the weight to two 1-pixel diagonal
    moves with reflected borders. Here probabilities are averaged (a mean of distributions, which the
    loss can read), the four moves are along the axes with zeros filled in, as ``data.augment``'s
    training shifts do, and every view weighs the same. On Fashion-MNIST (one checkpoint of the fashion
    recipe) the mirror took 92.83% to 92.99% with probabilities averaged and 93.00% with logits.

    ``five-crop``: the four corners' and the centre's crops of 0.875 of each side, each scaled back to the
    model's input size (torchvision's ``FiveCrop``, taken from the prepared image and resized since the model
    takes one size); ``multi-scale``: the image at 0.875, 1 and 1.125 of its size, centred (zeros around a smaller
    one, which after normalisation is the data set's mean colour; a larger one cropped), each with its mirror."""
    return mean_of_views(model, views(x, tta, shift))


def mean_of_views(model: nn.Module, views: list[torch.Tensor]) -> torch.Tensor:
    logp = torch.stack([torch.log_softmax(model(v).float(), 1) for v in views])
    return torch.logsumexp(logp, 0) - math.log(len(views))


def views(x: torch.Tensor, tta: str, shift: int = 1) -> list[torch.Tensor]:
    """The views ``tta_logits`` averages over, in ``x``'s memory layout."""
    layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    h, w = x.shape[2], x.shape[3]
    if tta == "five-crop":
        ch, cw = max(1, round(CROP * h)), max(1, round(CROP * w))
        corners = ((0, 0), (0, w - cw), (h - ch, 0), (h - ch, w - cw), ((h - ch) // 2, (w - cw) // 2))
        return [F.interpolate(x[:, :, i:i + ch, j:j + cw], size=(h, w), mode="bilinear", align_corners=False)
                .contiguous(memory_format=layout) for i, j in corners]
    if tta == "multi-scale":
        out = []
        for s in SCALES:
            v = x if s == 1.0 else _centred(F.interpolate(x, size=(max(1, round(s * h)), max(1, round(s * w))),
                                                          mode="bilinear", align_corners=False, antialias=s < 1), h, w)
            v = v.contiguous(memory_format=layout)
            out += [v, v.flip(3)]
        return out
    out = [x, x.flip(3)]
    if tta == "flip-shift" and shift > 0:
        s = shift
        padded = F.pad(x, (s, s, s, s))
        for dy, dx in ((0, s), (2 * s, s), (s, 0), (s, 2 * s)):
            v = padded[:, :, dy:dy + h, dx:dx + w].contiguous(memory_format=layout)
            out += [v, v.flip(3)]
    return out


def _centred(v: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``v`` cropped or zero-padded about its centre to h x w."""
    dh, dw = v.shape[2] - h, v.shape[3] - w
    if dh >= 0 and dw >= 0:
        return v[:, :, dh // 2:dh // 2 + h, dw // 2:dw // 2 + w]
    top, left = -dh // 2, -dw // 2
    return F.pad(v, (left, -dw - left, top, -dh - top))


class SplitEvaluator:
    """``evaluate`` with a run's model (its evaluation weights: EMA's average when on), data and ranks:
    ``evaluator(run, split, keep_errors)``. It owns what a validation chooses for the evaluations after it: the
    temperature (``train.calibrate``), fitted on the raw logits of each validation, which divides the logits of the
    test; several labels an image's threshold, the best on each validation, at which the test is scored."""

    def __init__(self, prep, loss_sum, readers: int, reader: int, group, lockstep: bool):
        self.prep, self.loss_sum, self.readers, self.reader = prep, loss_sum, readers, reader
        self.group, self.lockstep = group, lockstep
        self.temperature, self.threshold = 1.0, 0.5

    def __call__(self, run, split: Split, keep_errors: int = 0, validation: bool = False) -> dict:
        c = run.config
        fit, multilabel, kept = validation and c.train.calibrate, c.data.task == "multilabel", []
        with run.eval_weights():
            r = evaluate(run.forward, split, self.prep, run.device, run.precision, c.data.eval_batch_size,
                         run.data.num_classes, self.readers, self.reader, self.group, keep_errors,
                         c.data.num_workers, self.loss_sum, lockstep=self.lockstep, tta=c.data.tta,
                         shift=c.data.shift, limit=c.data.eval_limit, temperature=1.0 if fit else self.temperature,
                         keep=kept if fit else None, multilabel=multilabel,
                         threshold=None if validation else self.threshold)
        if multilabel and validation:
            self.threshold = r["threshold"]
        if fit:  # every rank (a collective), also one whose share was empty
            t = fit_temperature(kept, run.device, self.group)
            if r["accuracy"] is not None:
                self.temperature = r["temperature"] = t
        return r


    def recompute_bn(self, run) -> bool:
        """Batch norm's running statistics recomputed for the weights the model holds now: one pass over the training
        split, without augmentation or gradients, in training mode with cumulative averages
        (``torch.optim.swa_utils.update_bn``), each reader its equal share (FSDP's forward is a collective), then the
        statistics averaged over the readers. False where the model has no batch norm (nothing done)."""
        from torch.optim.swa_utils import update_bn  # a run without SWA never needs it

        norms = [m for m in run.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:
            return False
        c, split = run.config, run.data.train
        even = eval_count(split, 0) // self.readers * self.readers  # every reader the same number of batches
        if not even:  # fewer samples than readers (limit 0 would mean all of them, unevenly)
            return False
        inputs = (self.prep(x) for x, _ in eval_batches(split, c.data.eval_batch_size, run.device, self.readers,
                                                        self.reader, c.data.num_workers, even))
        with torch.no_grad(), dev.autocast(run.device, run.precision):
            update_bn(inputs, run.model)
        if self.readers > 1:
            for m in norms:
                for t in (m.running_mean, m.running_var):
                    if t is not None:
                        t.div_(self.readers)
                        all_reduce_sum(t, self.group)
        return True


def _fmt(r: dict, *keys) -> str:
    return " ".join(f"{k} {r[k]:.4f}" for k in keys if r.get(k) is not None)


def finish(run, metrics, wall_start: float, evaluate_split: SplitEvaluator, facts: dict, callbacks) -> dict:
    """Test evaluation, the summary (``summary.json``, rank 0) and the plots; returns the summary. ``facts``: what
    the trainer adds about how it trained (trainers, channels_last, compiled, model, strategy, memory at start);
    ``callbacks``: the run's ``CallbackList``, whose ``summary`` is added last."""
    cfg, data = run.config, run.data
    summary = {"epochs": round(run.step / run.steps_per_epoch, 4), "steps": run.step, "val_accuracy": None,
               "val_loss": None, "test_accuracy": None, "test_loss": None, "stopped": run.stopped,
               "not_learning": None}
    last_val = run.metrics if run.validated_at is not None else None
    if last_val is not None:
        summary.update(val_accuracy=last_val["accuracy"], val_loss=last_val["loss"],
                       **{f"val_{k}": last_val[k] for k in QUOTED if k in last_val})
    if data.test is not None:
        keep = 36 if run.is_main and cfg.train.plots and data.is_images else 0
        r = evaluate_split(run, data.test, keep)
        run.metrics = {k: v for k, v in r.items() if k != "errors"}
        summary.update(test_accuracy=r["accuracy"], test_loss=r["loss"], test_top5=r["top5"], test_images=r["count"],
                       **{f"test_{k}": r[k] for k in QUOTED if k in r})
        limited = r["count"] < len(data.test)
        if limited:
            summary["eval_limit"] = cfg.data.eval_limit
        metrics.write(kind="test", step=run.step, **{k: r.get(k) for k in (
            "loss", "accuracy", "top5", *QUOTED, "per_class_accuracy", "ap", "precision", "recall", "f1", "support",
            "confusion", "reliability") if k in r})
        part = f" (the first {r['count']:,} of {len(data.test):,} images)" if limited else ""
        shown = {'acc': r['accuracy'], 'top5': r['top5'], 'mAP': r.get('map'), 'f1_macro': r.get('f1_macro')}
        run.log.info(f"test {_fmt(r, 'loss')} {_fmt(shown, 'acc', 'top5', 'mAP', 'f1_macro')}".rstrip() + part)
        if run.is_main and "errors" in r:
            wrong_images, true, pred = r["errors"]
            errors = {"images": wrong_images, "true": true, "pred": pred, "classes": list(data.classes),
                      "mean": list(data.mean), "std": list(data.std)}
            write_torch(errors, run.run_dir / "test_errors.pt")
        elif run.is_main:  # no mistakes now: an earlier evaluation's errors (before a resume) are not this run's
            (run.run_dir / "test_errors.pt").unlink(missing_ok=True)
    summary.update(
        train_seconds=round(run.meter.train_seconds, 3), wall_seconds=round(time.perf_counter() - wall_start, 3),
        images_per_second=round(run.meter.images / max(run.meter.train_seconds, 1e-9), 1), device=str(run.device),
        world_size=run.world_size, mode=cfg.dist.mode, trainers=facts["trainers"], precision=run.precision,
        channels_last=facts["channels_last"], compiled=facts["compiled"], cuda_graphs=facts["cuda_graphs"], model=facts["model"], data=data.name,
        strategy=facts["strategy"], held_per_rank=fsdp.held_bytes(run.model, run.optimizer), **dev.peak_memory(run.device),
        host_rss_at_start_mb=round(facts["rss_at_start_mb"], 1),
        epoch_seconds=run.meter.epoch_seconds, run_dir=str(run.run_dir),
    )
    summary.update(callbacks.summary(run))  # what callbacks add (NotLearning's warning, stage 2's totals)
    if run.is_main:
        write_json(run.run_dir / "summary.json", summary)
        if cfg.train.plots:  # after summary.json is safely written; their time is added to it
            summary["plot_seconds"] = _plots(run)
            write_json(run.run_dir / "summary.json", summary)
    return summary


def _plots(run) -> float:
    start = time.perf_counter()
    try:
        plot_runs([run.run_dir])
    except BrickyardError as e:
        run.log.warning(f"no plots: {e}")
    return round(time.perf_counter() - start, 3)
