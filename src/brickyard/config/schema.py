"""The configuration schema: every key, its type, default, allowed values and one line of doc.

One frozen dataclass per section; ``Config`` holds them all. ``brickyard.config`` builds a ``Config``
from defaults, a YAML file and ``--set`` overrides and checks it against these declarations (each key
alone: ``config/values.py``), then each section checks itself (its ``check()``) and the rules across sections run
(``config/rules.py``); docs/configuration.md's table is generated from them (``python -m brickyard.config``)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from brickyard.config import checks
from brickyard.config.checks import BUILT_IN_LOGGERS, check_transform, init_method, logger_names, rand_augment_policy
from brickyard.config.dist import DistConfig, FSDPConfig, PipelineConfig, PSConfig  # noqa: F401  (the sections, from one place)
from brickyard.config.fields import Section, _opt
from brickyard.config.rules import RULES
from brickyard.config.values import with_changes
from brickyard.errors import ConfigError


@dataclass(frozen=True)
class SyntheticConfig(Section):
    num_train: int = _opt(2048, min=1, doc="training images")
    num_val: int = _opt(512, min=0, doc="validation images")
    num_test: int = _opt(512, min=0, doc="test images")
    channels: int = _opt(1, min=1)
    height: int = _opt(28, min=4)
    width: int = _opt(28, min=4)
    num_classes: int = _opt(10, min=2)


@dataclass(frozen=True)
class DataConfig(Section):
    name: str = _opt("mnist", choices=("mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic", "imagefolder", "mnist-mosaic", "fashion-mnist-mosaic"), doc="a *-mosaic set: 56 x 56 images of 1-4 digits or garments, tagged with the classes present (several labels an image; docs/training.md)")
    task: str = _opt("auto", choices=("auto", "single", "multilabel"), doc="one label an image (cross-entropy) or several (multilabel: binary cross-entropy, mean average precision, a threshold chosen on validation); auto: multilabel where the labels are multi-hot rows, said in the log")
    root: str | None = _opt(None, doc="folder holding this data set's files (imagefolder: train/, test/, val/ of class folders, or train.csv, val.csv, test.csv of image,tags beside them)")
    download: bool = _opt(True, doc="download missing files from the public mirrors")
    global_batch_size: int = _opt(256, min=0, doc="images per optimiser step over all devices and accumulation steps; the per-device batch follows from the world size (0 = data.batch_size x world x train.grad_accum)")
    batch_size: int | str = _opt(256, min=1, choices_str=("auto",), doc="per-device batch, used when global_batch_size is 0 (setting it alone sets that), or auto (the largest that fits)")
    eval_batch_size: int = _opt(250, min=1)
    eval_limit: int = _opt(0, min=0, doc="validate and test on the first N images of each split only (0 = all), as Lightning's limit_val_batches and limit_test_batches: a quick check of a recipe; the same images on any number of processes, and the log and summary.json say how many (`brickyard eval` reads the whole split)")
    train_on_all: bool = _opt(False, doc="train on every training image, no validation split: MNIST and Fashion-MNIST on 60,000, CIFAR on 50,000, an image folder without reading val/ (not with data.val_fraction)")
    loader: str = _opt("auto", choices=("auto", "memory", "stream"))
    num_workers: int | str = _opt("auto", min=0, max=256, choices_str=("auto",), doc="streaming loader worker processes; auto: planned against the cores (CPU: half of each process's cores decode, the other half train; GPU: the process's cores less one, at most 8; in-memory data: none)")
    prefetch: int = _opt(2, min=1, max=1024, doc="streaming loader batches prefetched per worker")
    pin_memory: bool = _opt(True)
    augment: str = _opt("none", choices=("none", "shift", "crop-flip"))
    shift: int = _opt(2, min=0, max=16, doc="pixels for shift / crop augmentation")
    rand_augment: str = _opt("", doc="RandAugment policy, timm's semantics: n2-m9 (2 operations per image, magnitude 9 of 10) or timm's rand-m9-mstd0.5; empty: off")
    random_erasing: float = _opt(0.0, min=0.0, max=1.0, doc="probability of erasing one rectangle of an image with noise (timm's --reprob, pixel mode)")
    mixup: float = _opt(0.0, min=0.0, max=100.0, doc="mixup Beta alpha, e.g. 0.2 (timm's --mixup); 0 = off; targets become class probabilities")
    cutmix: float = _opt(0.0, min=0.0, max=100.0, doc="cutmix Beta alpha, e.g. 1.0 (timm's --cutmix); with mixup, each batch uses one of the two at random")
    drop_last: bool = _opt(False, doc="training: leave out an epoch's last global batch when it is smaller than the others (torch's DataLoader drop_last; a DataLoader given to fit sets it); false keeps it, scaled by its size")
    balance: bool = _opt(False, doc="draw each epoch's training images at random with replacement, every class equally likely (torch's WeightedRandomSampler, weights 1 / the class's count), as many as the split holds: for a data set with rare classes")
    tta: str = _opt("none", choices=checks.TTA, doc="test-time augmentation for validation and test: flip averages each image's class probabilities with its mirror image's; flip-shift adds both moved data.shift pixels four ways (10 forward passes; data.shift at least 1); five-crop: the corners' and centre's crops of 0.875 of each side, scaled back (5 passes); multi-scale: the image at 0.875, 1 and 1.125 of its size and their mirrors (6 passes)")
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    classes: tuple = _opt((), doc="keep only these class indices (relabelled 0..k-1), e.g. [5, 6, 7, 8, 9]; at least 2, each once")
    train_per_class: int = _opt(0, min=0, doc="keep only the first N training images of each class (0 = all)")
    train_transforms: tuple = _opt(("auto",), doc="imagefolder training transforms; auto: small images (<= 64 px) at their own size, photos random_resized_crop:224, hflip; also resize:S, center_crop:S, random_crop:S[:P], grayscale, rgb")
    eval_transforms: tuple = _opt(("auto",), doc="imagefolder evaluation transforms; auto: small images at their own size, photos resize:256, center_crop:224")
    normalize: str = _opt("imagenet", choices=("imagenet", "mnist", "half", "none"), doc="imagefolder mean/std")
    channels: int = _opt(0, choices=(0, 1, 3), doc="imagefolder channels: 1 (grey) or 3 (colour); 0 = from the first training image")
    val_fraction: float = _opt(0.0, min=0.0, max=0.9, doc="hold out this fraction of the training images, drawn at random (seed 0), for validation: an image folder without val/, or fit's tensors without val_data (Keras's validation_split, which takes the last ones)")
    skip_bad_images: bool = _opt(False, doc="imagefolder: skip unreadable files with a warning instead of failing")
    folds: int = _opt(0, min=0, doc="k-fold cross-validation: the training and validation images together, cut into this many folds (stratified by class, seeded: the same on every run and any number of processes); data.fold is the validation split, the others train; 0 = the data set's own split (brickyard sweep --folds K runs each fold)")
    fold: int = _opt(0, min=0, doc="with data.folds: which fold (0..folds-1) validates")
    cache: str = _opt("none", choices=("none", "memory", "disk"), doc="imagefolder: memory keeps the deterministic part of each training image in shared memory after the first epoch; disk decodes every training image once into a uint8 file beside the data (ROOT/.brickyard-cache), memory-mapped by every later run and epoch")

    def check(self) -> None:
        if self.rand_augment:
            rand_augment_policy(self.rand_augment)
        for key in ("train_transforms", "eval_transforms"):
            specs = tuple(getattr(self, key))
            if specs != ("auto",):
                for spec in specs:
                    check_transform(f"data.{key}", spec)
        if self.folds == 1 or self.fold >= max(self.folds, 1):
            raise ConfigError(f"data.folds {self.folds}, data.fold {self.fold}: cross-validation takes 2 folds or more and "
                              f"a fold from 0 to folds - 1." if self.folds else
                              f"data.fold {self.fold} picks one of data.folds, which is 0 (no cross-validation).")
        if self.folds and self.val_fraction:
            raise ConfigError("data.folds cuts the validation split itself; drop data.val_fraction.")
        if self.train_on_all and self.val_fraction:
            raise ConfigError(f"data.train_on_all trains on every training image, so nothing is left for data.val_fraction "
                              f"({self.val_fraction}); set one of them.")
        kept = list(self.classes)
        twice = next((c for i, c in enumerate(kept) if c in kept[:i]), None)
        if twice is not None:
            raise ConfigError(f"data.classes: {twice!r} is listed twice; list each class index once.")
        if len(kept) == 1:
            raise ConfigError(f"data.classes: {kept} keeps one class; a classifier needs at least 2.")
        if self.tta == "flip-shift" and self.shift == 0:
            raise ConfigError("data.tta: flip-shift moves each image data.shift pixels four ways, and data.shift is 0; "
                              "set data.shift (e.g. 1), or data.tta: flip for the mirror alone.")


@dataclass(frozen=True)
class ModelConfig(Section):
    name: str = _opt("mnist_fast", doc="a name from `brickyard models`")
    num_classes: int = _opt(0, min=0, doc="0 = from the data set")
    in_channels: int = _opt(0, min=0, doc="0 = from the data set")
    patch_size: int = _opt(0, min=0, doc="vit_*: patch side in pixels (0 = auto: 4 for 28-32 px, 8 for 64 px, 16 for 224 px)")
    drop_path: float = _opt(0.0, min=0.0, max=0.95, doc="stochastic depth for the ResNets and ViTs: the last block's rate, rising linearly from 0 over the blocks (timm's --drop-path)")
    init: str = _opt("default", doc="weight initialisation of every conv and linear layer (biases zero): default (the model's own), normal:STD, xavier, xavier_normal, kaiming, kaiming_uniform")
    whiten: bool = _opt(False, doc="set the first convolution's filters from the training images (the principal directions of its patches, scaled to unit variance, and their negatives; airbench's whitening layer) and freeze them")
    head: str = _opt("default", choices=("default", "linear"), doc="vgg16: linear replaces the three-layer 4096-unit classifier with one linear layer on globally pooled features")

    def check(self) -> None:
        init_method(self.init)


@dataclass(frozen=True)
class ParamGroupRule(Section):
    match: str = _opt("*", doc="fnmatch pattern on parameter names, e.g. fc.* or *.bias")
    weight_decay: float | None = _opt(None, doc="decay for the matched parameters (None = optim.weight_decay)")
    lr_mult: float = _opt(1.0, min=0.0, doc="learning-rate multiplier")


# what each optimiser gets where the config does not say: torch.optim's own defaults (torch 2.13,
# inspect.signature of SGD, Adam, AdamW, Adagrad, Adadelta; tests/config compares), and momentum 0.9
# for brickyard's momentum and nesterov, which name SGD with momentum (torch's SGD default is none)
CONVENTIONAL: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 1e-3, "weight_decay": 0.0, "momentum": 0.0, "betas": (0.9, 0.999), "eps": 1e-8},
    "momentum": {"lr": 1e-3, "weight_decay": 0.0, "momentum": 0.9, "betas": (0.9, 0.999), "eps": 1e-8},
    "nesterov": {"lr": 1e-3, "weight_decay": 0.0, "momentum": 0.9, "betas": (0.9, 0.999), "eps": 1e-8},
    "adagrad": {"lr": 1e-2, "weight_decay": 0.0, "momentum": 0.9, "betas": (0.9, 0.999), "eps": 1e-10},
    "adadelta": {"lr": 1.0, "weight_decay": 0.0, "momentum": 0.9, "betas": (0.9, 0.999), "eps": 1e-6},
    "adam": {"lr": 1e-3, "weight_decay": 0.0, "momentum": 0.9, "betas": (0.9, 0.999), "eps": 1e-8},
    "adamw": {"lr": 1e-3, "weight_decay": 1e-2, "momentum": 0.9, "betas": (0.9, 0.999), "eps": 1e-8},
}
OPTIMISER_KEYS = ("lr", "momentum", "weight_decay", "betas", "eps")  # tuned per optimiser: not carried across a change
USED_BY = {"sgd": ("lr", "weight_decay"), "momentum": ("lr", "momentum", "weight_decay"),
           "nesterov": ("lr", "momentum", "weight_decay"), "adam": ("lr", "betas", "eps", "weight_decay"),
           "adamw": ("lr", "betas", "eps", "weight_decay"), "adagrad": ("lr", "eps", "weight_decay"),
           "adadelta": ("lr", "eps", "weight_decay")}


@dataclass(frozen=True)
class OptimConfig(Section):
    name: str = _opt("adam", choices=tuple(CONVENTIONAL))
    lr: float | str | None = _opt(None, min=0.0, choices_str=("find",), doc="base (peak) learning rate; null: the optimiser's torch default (1e-3; adagrad 1e-2, adadelta 1.0); find: the range test's suggestion (brickyard lr-find), run before training and written into the run's config")
    momentum: float | None = _opt(None, min=0.0, max=1.0, doc="momentum and nesterov; null: 0.9")
    weight_decay: float | None = _opt(None, min=0.0, doc="null: the optimiser's torch default (0; adamw 0.01)")
    betas: tuple | None = _opt(None, doc="adam, adamw; null: torch's (0.9, 0.999)")
    eps: float | None = _opt(None, min=0.0, doc="null: the optimiser's torch default (1e-8; adagrad 1e-10, adadelta 1e-6)")
    label_smoothing: float = _opt(0.0, min=0.0, max=1.0, doc="cross-entropy label smoothing (torch's default: 0)")
    class_weights: tuple = _opt((), doc="one weight a class for the training loss, as Keras's fit(class_weight=): each sample's cross-entropy times its class's weight, summed and divided by the batch; validation and test are not weighed; empty: all 1")
    param_groups: tuple = _opt((), item=ParamGroupRule, doc="rules [{match, weight_decay, lr_mult}], first match wins")
    decay_bias_norm: bool = _opt(True, doc="false: biases and norm-layer weights get no weight decay")
    l1: float = _opt(0.0, min=0.0, doc="L1 penalty on decayed parameters, added to the loss")

    def __post_init__(self):  # what the config leaves open is the chosen optimiser's convention, written out
        for key in OPTIMISER_KEYS:
            if getattr(self, key) is None:
                object.__setattr__(self, key, CONVENTIONAL[self.name][key])

    def check(self) -> None:
        betas = tuple(self.betas or ())  # never None here: __post_init__ wrote the convention
        if len(betas) != 2 or not all(isinstance(v, (int, float)) and 0 <= v < 1 for v in betas):
            raise ConfigError(f"optim.betas: {list(betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999].")
        bad = [w for w in self.class_weights
               if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0]
        if bad:  # their count is checked against the data's classes when training starts (training.step)
            raise ConfigError(f"optim.class_weights: {bad[0]!r} is not a weight (a finite number, 0 or more).")


@dataclass(frozen=True)
class ScheduleConfig(Section):
    name: str = _opt("constant", choices=("constant", "step", "cosine", "onecycle", "warmup_linear", "plateau", "none"),
                     doc="constant (as torch without a scheduler); plateau: constant, lowered by schedule.gamma when schedule.monitor has not improved for schedule.patience validations (Keras's ReduceLROnPlateau); none: brickyard leaves the optimiser's rates alone (a torch LR scheduler in a callback drives them)")
    warmup_epochs: float = _opt(0.0, min=0.0, doc="linear warm-up (warmup_linear, cosine, step, constant, plateau)")
    lr_init: float = _opt(0.0, min=0.0, doc="learning rate at the start of warm-up")
    lr_max: float | None = _opt(None, doc="peak rate; defaults to optim.lr")
    lr_end: float = _opt(0.0, min=0.0, doc="final rate (warmup_linear, cosine); plateau: the lowest rate it lowers to (Keras's min_lr)")
    step_epochs: float = _opt(1.0, min=0.0, doc="step: decay every this many epochs")
    gamma: float = _opt(0.1, min=0.0, max=1.0, doc="step: decay factor; plateau: the factor each reduction multiplies the rate by (Keras's factor; below 1)")
    pct_start: float = _opt(0.25, min=0.0, max=1.0, doc="onecycle: fraction of steps rising")
    monitor: str = _opt("val_loss", choices=checks.VAL_METRICS, doc="plateau: the validation metric watched")
    patience: int = _opt(10, min=0, doc="plateau: validations without improvement before the rate is lowered (Keras's default 10)")
    min_delta: float = _opt(1e-4, min=0.0, doc="plateau: smaller changes of schedule.monitor do not count as improvement")
    cooldown: int = _opt(0, min=0, doc="plateau: validations after a reduction during which none is counted")

    def check(self) -> None:
        if self.name == "plateau" and not 0 < self.gamma < 1:
            raise ConfigError(f"schedule.gamma: {self.gamma:g} must lie between 0 and 1 for schedule.name plateau "
                              f"(each reduction multiplies the rate by it), e.g. 0.1 or 0.5.")


@dataclass(frozen=True)
class SWAConfig(Section):
    start: float = _opt(0.0, min=0.0, max=1e6, doc="stochastic weight averaging from here: below 1 a fraction of the run's steps (0.75: its last quarter), else the epoch it begins in, counted from 1 (Lightning's swa_epoch_start); validation, best.pt and the final weights use the average (0 = off); docs/training.md")
    lr: float = _opt(0.0, min=0.0, doc="the rate it anneals to from its start and then holds (torch's SWALR, cosine); 0: the schedule's rate goes on")
    anneal: float = _opt(0.2, min=0.0, max=1.0, doc="the part of the averaging phase over which the rate anneals to train.swa.lr")
    every: int | str = _opt("auto", min=1, choices_str=("auto",), doc="steps between averages; auto: once an epoch, or ten times in a phase shorter than ten epochs")
    bn_update: bool = _opt(True, doc="recompute batch norm's statistics for the average before the last validation, with one pass over the training data (torch's update_bn); models without batch norm skip it")

    def check(self) -> None:
        if self.start >= 1 and self.start != int(self.start):
            raise ConfigError(f"train.swa.start: {self.start} is neither a fraction of the run (below 1, e.g. 0.75) nor an epoch (a whole number from 1).")


@dataclass(frozen=True)
class TrainConfig(Section):
    epochs: float = _opt(1.0, min=0.0, max=1e6, doc="may be fractional")
    max_steps: int = _opt(0, min=0, doc="stop after this many optimiser steps (0 = no limit); the schedule is still planned over train.epochs (with epochs 0: over max_steps)")
    stop_epoch: float = _opt(0.0, min=0.0, max=1e6, doc="stop after this many epochs, the schedule planned over train.epochs (plan 90, stop at 70; 0 = at train.epochs)")
    device: str = _opt("auto", doc="auto, cpu, cuda, cuda:N")
    precision: str = _opt("auto", choices=("auto", "fp32", "bf16", "fp16"))
    channels_last: bool | str = _opt("auto", choices=(True, False, "auto"))
    compile: bool | str = _opt(False, choices=(True, False, "auto"), doc="torch.compile the model; auto: on CUDA for models of at least 5M parameters and runs of at least 15,000 steps, never on CPUs (see docs/training.md)")
    cuda_graphs: bool | str = _opt("auto", choices=(True, False, "auto"), doc="capture the training step as a CUDA graph and replay it (one process on a GPU); auto: for models under 5M parameters where nothing in the step forbids it, and the log says what did (see docs/training.md)")
    activation_checkpointing: tuple | str = _opt((), choices_str=("auto",), names=True, doc="module name patterns (e.g. [blocks.*]) whose activations are recomputed in the backward pass, or auto (per model family)")
    grad_accum: int = _opt(1, min=1)
    grad_clip: float = _opt(0.0, min=0.0, doc="max gradient norm (0 = off)")
    seed: int = _opt(0, min=0)
    deterministic: bool = _opt(False, doc="deterministic kernels only (CUDA: `brickyard train` sets CUBLAS_WORKSPACE_CONFIG)")
    log_every: int | str = _opt("auto", min=1, choices_str=("auto",), doc="steps between loss read-backs (each a host sync); auto: about 50 a run (its steps / 50), at least 10 steps apart on a GPU")
    eval_every: int = _opt(1, min=0, doc="epochs between validations (0 = only at the end)")
    test_every: int = _opt(0, min=0, doc="epochs between test evaluations during training (0 = only at the end)")
    progress: str = _opt("auto", choices=("auto", "bar", "plain", "none"))
    threads: int = _opt(0, min=0, max=1024, doc="CPU intra-op threads per process (0 = cores / local processes)")
    pin_cpus: bool = _opt(False, doc="CPU runs of several local processes: keep each on its own cores (measured: no gain with grad_sync flat)")
    tune_allocator: bool = _opt(True, doc="CPU runs on Linux: keep freed memory in glibc's heap instead of returning it each step")
    loggers: tuple = _opt(("tensorboard",), doc="where metrics go besides metrics.jsonl: any of tensorboard, csv (RUN_DIR/metrics.csv), mlflow (MLFLOW_TRACKING_URI), wandb (WANDB_MODE, WANDB_PROJECT); rank 0")
    tensorboard: bool = _opt(True, doc="false drops tensorboard from train.loggers (kept for one version: use train.loggers)")
    plots: bool = _opt(True, doc="write PNG curves, confusion matrix and misclassified images at the end")
    histograms_every: int = _opt(0, min=0, doc="steps between weight/gradient histograms (0 = off)")
    watch: tuple = _opt((), names=True, doc="module name patterns whose activations and gradients are logged, e.g. [conv*, fc]")
    watch_every: int = _opt(200, min=1)
    nan_guard: bool = _opt(True, doc="stop with the offending layer named when the loss becomes non-finite")
    stop_if_not_learning: bool = _opt(False, doc="end the run (exit 1) when the training loss sits at chance for 3 log windows; off: a warning")
    early_stopping: int = _opt(0, min=0, doc="stop after this many validations without improvement (0 = off)")
    early_stopping_monitor: str = _opt("val_loss", choices=checks.VAL_METRICS)
    early_stopping_min_delta: float = _opt(0.0, min=0.0, doc="smaller changes do not count as improvement")
    ema: float = _opt(0.0, min=0.0, max=0.999999, doc="weight averaging decay, e.g. 0.999; evaluation and best.pt use the average (0 = off)")
    swa: SWAConfig = field(default_factory=SWAConfig)
    calibrate: bool = _opt(False, doc="temperature scaling: at each validation, fit the temperature dividing the logits that minimises the validation loss; the checkpoints keep it and the test, eval and predict use it (--uncalibrated: the raw outputs); docs/observability.md")
    max_time_s: float = _opt(0.0, min=0.0, max=1e9, doc="stop the training loop after this many seconds, with a checkpoint (0 = no limit)")
    csv_log: bool = _opt(False, doc="true adds csv to train.loggers (kept for one version: use train.loggers)")
    profile_steps: tuple = _opt((), doc="[a, b]: record steps a to b - 1 with torch.profiler (CPU operators; CUDA kernels on GPUs) into train.profile_dir, for TensorBoard's profile plugin or Chrome's trace viewer")
    profile_dir: str | None = _opt(None, doc="where profile traces go (default RUN_DIR/profile)")

    def check(self) -> None:
        self.swa.check()
        if self.swa.start and self.ema:
            raise ConfigError("train.swa and train.ema each choose the weights evaluated and saved; turn one off.")
        steps = tuple(self.profile_steps)
        if steps and (len(steps) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in steps)
                      or steps[1] <= steps[0] or steps[1] - steps[0] > 1000):
            raise ConfigError(f"train.profile_steps: {list(steps)} must be [first, last] step numbers, first < last, "
                              f"at most 1,000 steps apart, e.g. [10, 15].")
        unknown = [name for name in self.loggers if name not in BUILT_IN_LOGGERS]
        names = logger_names() if unknown else BUILT_IN_LOGGERS  # the entry points are read only for a name of theirs
        for name in unknown:
            if name not in names:
                raise ConfigError(f"train.loggers: {name!r} is not one of {', '.join(names)}.")


def loggers(t) -> set[str]:
    """The loggers a ``TrainConfig`` asks for: ``train.loggers`` with the older switches applied."""
    chosen = set(t.loggers)
    if not t.tensorboard:
        chosen.discard("tensorboard")
    if t.csv_log:
        chosen.add("csv")
    return chosen


@dataclass(frozen=True)
class CheckpointConfig(Section):
    every_steps: int = _opt(0, min=0, doc="0 = off")
    every_epoch: bool = _opt(True)
    keep_last: int = _opt(2, min=1)
    keep_best: bool = _opt(True)
    monitor: str = _opt("auto", choices=("auto", *checks.VAL_METRICS), doc="the validation metric that picks best.pt (lower loss, higher accuracy and scores such as val_f1_macro); auto: val_accuracy where the run scores accuracy, val_map where it tags several labels an image, else val_loss (Keras's ModelCheckpoint watches val_loss by default)")


@dataclass(frozen=True)
class FinetuneConfig(Section):
    init_from: str | None = _opt(None, doc="brickyard checkpoint or state_dict (.pt, .pth, .safetensors), or published weights: torchvision:resnet18, torchvision:resnet50, torchvision:vgg16")
    reset_head: bool = _opt(False, doc="replace the classifier for model.num_classes (Xavier init)")
    freeze: tuple = _opt((), names=True, doc="parameter name patterns to freeze, e.g. [conv1.*, layer1.*], or all_but_last:N (every layer but the last N that hold parameters)")
    head_lr_mult: float = _opt(1.0, min=0.0, doc="learning-rate multiplier for the classifier")

    def check(self) -> None:
        for item in self.freeze:
            if str(item).startswith("all_but_last") and not str(item).partition(":")[2].strip().isdigit():
                raise ConfigError(f"finetune.freeze: {item!r}: write all_but_last:N, N the number of layers left to train.")


@dataclass(frozen=True)
class SnapshotConfig(Section):
    enabled: bool = _opt(False, doc="save flattened trainable parameters during training (stage 1)")
    start_epoch: float = _opt(0.0, min=0.0, doc="first epoch to take snapshots in (0 includes the initial weights)")
    every_steps: int | str = _opt("auto", min=0, choices_str=("auto",), doc="steps between snapshots; auto: spread keep of them over the epochs from start_epoch on; 0 = once per epoch")
    keep: int = _opt(40, min=2, doc="snapshots kept (must exceed dim_reduce.n_components)")
    include_init: bool = _opt(False, doc="the initial weights are the first snapshot also when start_epoch > 0 (stage 2 from the initial weights)")


@dataclass(frozen=True)
class DimReduceConfig(Section):
    enabled: bool = _opt(False, doc="stage 2: P-BFGS in the subspace of the stage-1 trajectory")
    method: str = _opt("dldr", choices=("dldr", "mindspore"), doc="the paper authors' P-BFGS (nblt/DLDR) or MindSpore Boost's; docs/dimension-reduction.md")
    n_components: int = _opt(32, min=1)
    rho: float | None = _opt(None, doc="line-search backtracking factor (default: dldr 0.4, mindspore 0.55)")
    sigma: float = _opt(0.4, min=0.0, max=1.0, doc="Armijo sufficient-decrease constant")
    gamma: float = _opt(0.9, min=0.0, max=1.0, doc="residual momentum decay")
    alpha: float | None = _opt(None, doc="residual momentum step size (default: dldr 0, mindspore 0.001)")
    max_search: int | None = _opt(None, doc="line-search step sizes tried per step (default: dldr 20, mindspore 2)")
    batch_size: int = _opt(0, min=0, doc="brickyard boost dim-reduce: stage 2's global batch (0 = data.global_batch_size)")
    snapshots_dir: str | None = _opt(None, doc="stage-1 snapshots (default RUN_DIR/snapshots)")
    pca_path: str | None = _opt(None, doc="a saved pca.pt to use instead of the snapshots")

    def check(self) -> None:
        if self.rho is not None and not 0 < self.rho < 1:
            raise ConfigError(f"boost.dim_reduce.rho: {self.rho} must be between 0 and 1 (the backtracking factor, e.g. 0.4).")
        if self.alpha is not None and self.alpha < 0:
            raise ConfigError(f"boost.dim_reduce.alpha: {self.alpha} must be at least 0.")
        if self.max_search is not None and (isinstance(self.max_search, bool) or not isinstance(self.max_search, int)
                                            or self.max_search < 1):
            raise ConfigError(f"boost.dim_reduce.max_search: {self.max_search} must be a whole number of at least 1.")


@dataclass(frozen=True)
class BoostConfig(Section):
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    dim_reduce: DimReduceConfig = field(default_factory=DimReduceConfig)

    def check(self) -> None:  # boost.snapshots.keep against dim_reduce.n_components: config/rules.py, for its precedence
        self.dim_reduce.check()


@dataclass(frozen=True)
class Config:
    preset: str = _opt("custom")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    boost: BoostConfig = field(default_factory=BoostConfig)

    def to_dict(self) -> dict:
        return _to_plain(dataclasses.asdict(self))

    def check(self) -> None:
        """Every section checks itself (in the order above), then every rule across sections runs
        (``config/rules.py``, in its order); the first rule broken raises ``ConfigError``. Run when a
        config is built or replaced: before any process starts, data loads or training begins."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if isinstance(section, Section):
                section.check()
        for rule in RULES:
            rule(self)

    def replace(self, **changes) -> Config:
        """A copy with dotted-key changes (``cfg.replace(**{"data.batch_size": 64})``), as ``--set`` would
        make them: each new value passes the loader's check of its key, ``data.batch_size`` without
        ``data.global_batch_size`` sets that 0 and a new ``optim.name`` takes its own conventions
        (``per_device_wins``, ``switch_optimiser``); then ``check()``. Every other value is kept as it is."""
        keys = [k.strip() for k in changes]
        wins: dict = {}
        per_device_wins(wins, keys)
        edits = [([section, name], v) for section, values in wins.items() for name, v in values.items()]
        for key, value in zip(keys, changes.values(), strict=True):
            if key == "optim.name":
                optim = dataclasses.asdict(self.optim)
                switch_optimiser(optim, value, {k.split(".", 1)[1] for k in keys if k.startswith("optim.")}, "--set", None)
                edits += [(["optim", k], None) for k in OPTIMISER_KEYS if k not in optim]  # None: the new one's convention
            edits.append((key.split("."), value))
        cfg = with_changes(self, edits)
        cfg.check()
        return cfg


def _to_plain(value):
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def per_device_wins(raw: dict, keys=None) -> None:
    """A config that names ``data.batch_size`` (the per-device batch) without ``data.global_batch_size``
    gets what it asked for: the global batch then follows the world size (``global_batch_size: 0``).
    ``keys``: the dotted keys set at this level (overrides); else the keys in ``raw`` itself."""
    data: dict = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    named = set(keys) if keys is not None else {f"data.{k}" for k in data}
    if "data.batch_size" in named and "data.global_batch_size" not in named:
        raw.setdefault("data", {})["global_batch_size"] = 0


def switch_optimiser(optim: dict, new: str, kept, where: str, notes: list | None) -> None:
    """``optim`` (a raw section) is getting optimiser ``new``: the settings tuned for the old one that
    ``kept`` (the keys set together with the change) does not name are dropped, so ``new`` gets its own
    conventions (``CONVENTIONAL``) instead of another optimiser's tuned rate; said in ``notes``."""
    old = optim.get("name", OptimConfig.name)
    if new == old or not isinstance(new, str):  # not a name: the type check says so, naming the key
        return
    dropped = [k for k in OPTIMISER_KEYS if k in optim and k not in kept]
    for k in dropped:
        optim.pop(k)
    relevant = [k for k in USED_BY.get(new, ()) if k not in kept]
    if dropped and relevant and notes is not None:
        shown = ", ".join(f"optim.{k} {list(CONVENTIONAL[new][k]) if k == 'betas' else CONVENTIONAL[new][k]}" for k in relevant)
        notes.append(f"optim.name {new} ({where}) replaces {old}: {shown} are {new}'s conventional settings, not "
                     f"the ones tuned for {old}; set them to choose others")
