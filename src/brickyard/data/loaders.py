"""Two loading paths behind one interface, both driven by the same ``BatchPlan``.

- ``InMemoryLoader``: the whole split as one tensor on the training device; batches are index
  slices of a seeded per-epoch permutation. No worker processes, no host round trips.
- ``StreamLoader``: a ``torch.utils.data.DataLoader`` with workers, prefetching and pinned memory,
  fed by the same plan through a batch sampler, for data that does not fit.

Both yield ``(x, y, n_global, offset)`` where ``x`` is still raw (uint8 or float), ``n_global`` is
the number of samples in this step's *global* batch (all ranks together) and ``offset`` is where
this rank's part starts in it. The trainer scales the loss by ``n_global`` so gradients are exact
means also for a short last batch, and augmentation draws randomness for the global batch and
uses this rank's slice, so N ranks see exactly what one process would. Because both paths follow
one plan, they produce the same batches, and a run resumed at step k of an epoch sees exactly
the batches it would have seen.
"""
from __future__ import annotations

import os

import torch

from brickyard.data.bundle import Draw, Split
from brickyard.errors import BrickyardError, ConfigError, DataError


class BatchPlan:
    """Which sample indices rank ``rank`` uses at each step of each epoch.

    Epoch ``e`` uses ``randperm(n)`` seeded with ``(seed, e)``; step ``s`` takes the global batch
    ``perm[s*G:(s+1)*G]`` (G = ``global_batch``, default batch_size x world) and this rank gets its
    contiguous part (``tensor_split``: parts differ by at most one when the world does not divide G),
    so the ranks' shards are disjoint and together cover the epoch. The batches depend on G, never
    on the world size, so any number of ranks (and a resume on another number) sees the same global
    batches. A final partial global batch is kept when every rank gets at least one sample, and left out with
    ``drop_last`` (``data.drop_last``: torch's DataLoader ``drop_last``, for the global batch).

    ``draw`` (a DataLoader's weighted or replacement sampler, ``bundle.Draw``): the epoch is the ``draw.count``
    indices drawn with the same seeded generator in place of the permutation, sharded the same way. Lightning
    instead has each rank run the sampler itself and shards the list (``DistributedSamplerWrapper`` in
    src/lightning/fabric/utilities/distributed.py at commit 036b499), so its ranks agree only where every RNG
    was seeded alike; here the draw is a function of (seed, epoch) and a resume redraws the same epoch.
    """

    def __init__(self, n: int, batch_size: int, world: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True,
                 global_batch: int | None = None, draw: Draw | None = None, drop_last: bool = False):
        self.size, self.draw = n, draw  # samples in the split; an epoch reads n of them (draw.count when drawn)
        n = draw.count if draw is not None else n
        self.n, self.batch_size, self.world, self.rank, self.seed, self.shuffle = n, batch_size, world, rank, seed, shuffle
        self.global_batch = global_batch or batch_size * world
        if self.global_batch < world:
            raise ConfigError(f"data.global_batch_size: a global batch of {self.global_batch} (per accumulation step) "
                              f"is smaller than the {world} processes; each needs at least one image.")
        full, rem = divmod(n, self.global_batch)
        self.steps_per_epoch = full + (1 if rem >= world and not drop_last else 0)
        if self.steps_per_epoch == 0 and drop_last and n >= world:
            raise DataError(f"data.drop_last leaves out an epoch's last partial global batch, and an epoch of {n} samples "
                            f"is shorter than the global batch of {self.global_batch}: nothing is left to train on; use a "
                            f"smaller batch or data.drop_last false.")
        if self.steps_per_epoch == 0:
            what = f"an epoch draws {n} samples" if draw is not None else f"the training split has {n} samples"
            raise DataError(f"{what}, fewer than the {world} ranks; use a smaller world size.")

    def permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return self.draw.indices(self.size, g) if self.draw is not None else torch.randperm(self.n, generator=g)

    def n_global(self, step: int) -> int:
        return min(self.global_batch, self.n - step * self.global_batch)

    def offset(self, n_global: int) -> int:
        """Start of this rank's part of a global batch of ``n_global`` (``tensor_split`` sizes)."""
        return self.rank * (n_global // self.world) + min(self.rank, n_global % self.world)

    def batches(self, epoch: int, start: int = 0, device: torch.device | None = None):
        """Yield ``(local_indices, n_global)`` for steps ``start..steps_per_epoch-1`` (indices on ``device``)."""
        perm = self.permutation(epoch)
        if device is not None:
            perm = perm.to(device)
        for step in range(start, self.steps_per_epoch):
            chunk = perm[step * self.global_batch:(step + 1) * self.global_batch]
            yield chunk.tensor_split(self.world)[self.rank], len(chunk)


class InMemoryLoader:
    def __init__(self, split: Split, plan: BatchPlan, device: torch.device):
        self.plan = plan
        self.images = split.images.to(device)
        self.labels = split.labels.to(device)
        self.device = device

    def epoch(self, epoch: int, start: int = 0):
        for idx, n_global in self.plan.batches(epoch, start, self.device):
            yield self.images[idx], self.labels[idx], n_global, self.plan.offset(n_global)

    def close(self):
        pass


class _PlanSampler(torch.utils.data.Sampler):
    """A batch sampler whose epoch and start step are set before each pass. For a dataset that draws its
    random transforms from a seed it is given (``seeded``: the image folders), each key is ``(index, seed)``
    with the seed fixed by the run's seed, the epoch and the sample (in a drawn epoch, ``plan.draw``, the
    sample's place in the epoch, so two draws of one image get two crops): the crops and flips of an image do
    not depend on the number of processes, the loader's workers or where a resumed run starts."""

    def __init__(self, plan: BatchPlan, seeded: bool = False):
        self.plan, self.epoch, self.start, self.seeded = plan, 0, 0, seeded

    def __iter__(self):
        base = (self.plan.seed * 1_000_003 + self.epoch) * 0x9E3779B1
        for step, (idx, n_global) in enumerate(self.plan.batches(self.epoch, self.start), self.start):
            idx = idx.tolist()
            if not self.seeded:
                yield idx
                continue
            first = step * self.plan.global_batch + self.plan.offset(n_global)
            keys = range(first, first + len(idx)) if self.plan.draw is not None else idx  # a draw repeats images
            yield [(i, (base + k) % (1 << 62)) for i, k in zip(idx, keys)]

    def __len__(self):
        return self.plan.steps_per_epoch - self.start


class StreamLoader:
    def __init__(self, split: Split, plan: BatchPlan, device: torch.device, num_workers: int = 2,
                 prefetch: int = 2, pin_memory: bool = True):
        self.plan, self.device = plan, device
        self.sampler = _PlanSampler(plan, getattr(split.dataset, "seeded", False))
        kwargs = dict(num_workers=num_workers, pin_memory=pin_memory and device.type == "cuda", **_batching(split))
        if num_workers > 0:
            kwargs.update(prefetch_factor=prefetch, persistent_workers=True)
        self.loader = torch.utils.data.DataLoader(split.as_dataset(), batch_sampler=self.sampler, **kwargs)

    def epoch(self, epoch: int, start: int = 0):
        self.sampler.epoch, self.sampler.start = epoch, start
        non_blocking = self.device.type == "cuda"
        for step, (x, y) in enumerate(_clean_errors(self.loader), start):
            n = self.plan.n_global(step)
            yield x.to(self.device, non_blocking=non_blocking), y.to(self.device, non_blocking=non_blocking), n, self.plan.offset(n)

    def close(self):
        del self.loader


def collate(items):
    """torch's ``default_collate``, and one sentence where inputs of different sizes cannot be stacked
    (photos of many sizes through transforms that do not end at a fixed size)."""
    shapes = {tuple(item[0].shape) for item in items if isinstance(item, (tuple, list)) and isinstance(item[0], torch.Tensor)}
    if len(shapes) > 1:  # checked before: in a worker, torch's own error is "Trying to resize storage that is not resizable"
        sizes = sorted("x".join(map(str, shape)) for shape in shapes)
        raise DataError(f"inputs of different sizes meet in one batch ({', '.join(sizes[:3])}{', ...' if len(sizes) > 3 else ''}): "
                        "end data.train_transforms and data.eval_transforms with a fixed size (resize:HxW, center_crop:S, "
                        "random_resized_crop:S), or give inputs of one size.")
    return torch.utils.data.default_collate(items)


def _batching(split: Split) -> dict:
    """The DataLoader arguments a split's loaders share, training and evaluation alike: its collate (the user's
    loader's own, else brickyard's) and its loader's ``worker_init_fn``."""
    return dict(collate_fn=split.collate or collate, worker_init_fn=split.worker_init)


def _clean_errors(iterable):
    """Re-raise a worker's DataError as the one sentence it was, without the worker traceback."""
    try:
        yield from iterable
    except DataError as e:
        lines = [l for l in str(e).splitlines() if l.strip()]
        last = lines[-1] if lines else str(e)
        raise DataError(last.split("DataError: ", 1)[-1]) from None


def step_batch(cfg, accum: int, world: int) -> int:
    """Images in one micro-step over all ranks: ``data.global_batch_size / train.grad_accum`` when the
    recipe fixes the global batch, else ``data.batch_size x world`` (``cfg`` is the ``data`` section)."""
    if cfg.global_batch_size:
        return cfg.global_batch_size // accum
    return cfg.batch_size * world


def readers_of(cfg, world: int) -> int:
    """How many of a job's ``world`` processes read data: all but the parameter servers; one a pipeline (its
    stages read the same share) and one a tensor-parallel group (its ranks read the same batch). ``cfg`` is the
    whole Config."""
    split = cfg.dist.pipeline.stages * cfg.dist.tensor_parallel
    if split > 1:
        return max(1, world // split)
    return world - (cfg.dist.ps.servers if cfg.dist.mode == "ps" else 0)


def check_readers(cfg, world: int, n_train: int | None = None) -> None:
    """Every process that reads data (all of them, less the parameter servers) gets at least one image
    of each global batch and of the training split (``n_train``, when known); one sentence otherwise.
    ``cfg`` is the whole Config. The launcher calls it before any worker starts, ``train`` before
    anything is written."""
    readers = readers_of(cfg, world)
    if readers < 1:
        return  # the parameter-server layout check says it
    if n_train is not None and n_train < readers:
        raise BrickyardError(f"the training split has {n_train} samples, fewer than the {readers} processes that "
                             f"read data; use fewer processes or more data.")
    d, accum = cfg.data, cfg.train.grad_accum
    if d.global_batch_size and d.global_batch_size // accum < readers:
        raise BrickyardError(f"data.global_batch_size: {d.global_batch_size} over {accum} accumulation step(s) is "
                             f"smaller than the {readers} processes that read data; each needs at least one image.")


def device_batches(cfg, accum: int, world: int) -> list[int]:
    """Each rank's share of a micro-step's global batch (they differ by at most one)."""
    g = step_batch(cfg, accum, world)
    return [g // world + (1 if r < g % world else 0) for r in range(world)]


def plan_workers(value, streams: bool, cpu: bool, cores: int) -> int:
    """``data.num_workers`` for a process with ``cores`` CPUs of its own: a number is kept (asked for);
    ``auto`` gives in-memory data none, a CPU run half of the process's cores (its training threads take
    the rest, so processes x (threads + workers) stays within the machine's cores), a GPU run the cores
    less the one the training process drives the GPU with, at most 8.

    Why a plan and not a measurement: the best count moves during a run (the first epoch decodes JPEGs
    from a cold page cache, later ones read a warm one or ``data.cache``), so a few timed steps at the
    start would measure the wrong epoch, and each trial count costs a pool of processes started and
    stopped (seconds each). The split itself was measured (``benchmarks/imagefolder_speed.py``): half
    the cores decoding beat both one worker and all cores on the 2-core machines."""
    if value != "auto":
        return int(value)
    if not streams:
        return 0
    return cores // 2 if cpu else max(0, min(8, cores - 1))


def stream_workers(value, device: torch.device, world: int) -> int:
    """``data.num_workers`` (``value``) of a streaming loader in one of ``world`` processes sharing this machine."""
    return plan_workers(value, True, device.type == "cpu", _own_cores(world))


def _own_cores(world: int) -> int:
    """This process's share of the CPUs it may run on, when ``world`` processes share them (``auto``
    workers outside ``train()``, which plans them with its threads in ``training.device.setup``)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, usable // max(1, world))


def make_train_loader(split: Split, cfg, device: torch.device, world: int, rank: int, seed: int, accum: int = 1):
    """The loader ``data.loader`` asks for (``auto``: in memory when the split is a tensor)."""
    g = step_batch(cfg, accum, world)
    plan = BatchPlan(len(split), max(1, g // world), world, rank, seed, global_batch=g, draw=split.draw,
                     drop_last=cfg.drop_last)
    kind = cfg.loader
    if kind == "auto":
        kind = "memory" if split.images is not None else "stream"
    if kind == "memory" and split.images is None:
        raise ConfigError("data.loader: 'memory' needs a data set held as tensors; this one streams from files, use stream.")
    if kind == "memory":
        return InMemoryLoader(split, plan, device)
    return StreamLoader(split, plan, device, stream_workers(cfg.num_workers, device, world), cfg.prefetch, cfg.pin_memory)


def eval_count(split: Split, limit: int = 0) -> int:
    """How many of ``split``'s samples an evaluation reads: the first ``limit`` (0: all)."""
    return min(len(split), limit) if limit else len(split)


def eval_batches(split: Split, batch_size: int, device: torch.device, world: int = 1, rank: int = 0, num_workers: int = 0,
                 limit: int = 0):
    """This rank's contiguous, unpadded share of ``split`` in batches: every sample counted once. ``limit``:
    the first that many samples only (``data.eval_limit``; 0: all), shared out the same way."""
    mine = torch.arange(eval_count(split, limit)).tensor_split(world)[rank]
    if split.images is not None:
        for chunk in mine.split(batch_size):
            yield split.images[chunk].to(device), split.labels[chunk].to(device)
        return
    keys = mine.tolist()
    if getattr(split.dataset, "seeded", False):  # random eval transforms, if any, draw the same on every run
        keys = [(i, i) for i in keys]
    subset = torch.utils.data.Subset(split.dataset, keys)
    loader = torch.utils.data.DataLoader(subset, batch_size=batch_size, num_workers=stream_workers(num_workers, device, world),
                                         **_batching(split))
    for x, y in _clean_errors(loader):
        yield x.to(device), y.to(device)
