"""``Split`` (tensors or a Dataset) and ``DataBundle`` (train / val / test splits and what describes them)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Draw:
    """An epoch of ``count`` sample indices drawn at random in place of a permutation of every sample, as a
    DataLoader's ``WeightedRandomSampler`` or ``RandomSampler(replacement=True)`` / ``num_samples=`` draws them:
    by ``weights`` (one per sample) where given, else uniformly; with or without ``replacement``. The generator
    is the batch plan's, seeded by the run's seed and the epoch, so every process draws the same epoch."""
    count: int
    weights: torch.Tensor | None = None
    replacement: bool = True
    by_class: bool = False  # data.balance's, not a DataLoader's sampler

    def indices(self, n: int, g: torch.Generator) -> torch.Tensor:
        if self.weights is not None:
            return torch.multinomial(self.weights, self.count, self.replacement, generator=g)
        if self.replacement:
            return torch.randint(n, (self.count,), generator=g)
        return torch.cat([torch.randperm(n, generator=g) for _ in range(-(-self.count // n))])[:self.count]


@dataclass
class Split:
    images: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    dataset: torch.utils.data.Dataset | None = None
    draw: Draw | None = None  # training: how an epoch's indices are drawn (None: a permutation of every sample)
    collate: object = None  # a DataLoader's own collate_fn (``adapters.UserCollate``): the dataset's items as it batches them
    worker_init: object = None  # a DataLoader's worker_init_fn: called in each loader worker process, as torch calls it

    def __len__(self) -> int:
        return len(self.labels) if self.labels is not None else len(self.dataset)

    def as_dataset(self) -> torch.utils.data.Dataset:
        if self.dataset is not None:
            return self.dataset
        return torch.utils.data.TensorDataset(self.images, self.labels)


@dataclass
class DataBundle:
    name: str
    train: Split
    val: Split | None
    test: Split | None
    num_classes: int
    in_channels: int
    image_size: tuple[int, int]
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    classes: list[str] = field(default_factory=list)

    sample_shape: tuple = ()  # one input's shape; C x H x W for images
    train_size: tuple | None = None  # training images' H x W where it differs from image_size (an image folder's transforms)
    notes: list[str] = field(default_factory=list)  # what was made of the data, for the run's log
    multilabel: bool = False  # labels are multi-hot rows: several tags an image (data.task: auto reads it)

    @property
    def in_memory(self) -> bool:
        return self.train.images is not None

    @property
    def is_images(self) -> bool:
        """Inputs are C x H x W images: channels_last, augmentation and image plots apply."""
        return len(self.sample_shape) == 3 or not self.sample_shape and len(self.image_size) == 2


def held_out(n: int, fraction: float) -> tuple[list[int], list[int]]:
    """``data.val_fraction`` of ``n`` samples: ``(validation, training)`` indices, ``max(1, int(n * fraction))``
    of them drawn at random (seed 0, the same on every rank and run), each part in the order drawn."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    n_val = max(1, int(n * fraction))
    return order[:n_val], order[n_val:]
