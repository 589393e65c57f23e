"""Image-folder data sets: ``ROOT/train/<class>/*.png|jpg``, ``ROOT/test/...``, optional ``ROOT/val/...``.

Class names are the sorted folder names of ``train``. Images are decoded with Pillow in the
DataLoader workers.

Reading is fast by construction (``read``): the pipeline's geometry (``Pipeline.plan``) is worked out
from the file's header before anything is decoded, so a JPEG is decoded at the smallest of its
built-in reduced scales (1/2, 1/4, 1/8: Pillow's ``draft``) that still covers the output at full
resolution, only the region that ends in the output is resampled, once, by torch's antialiased
bilinear filter on uint8 (``_resample``); normalisation and augmentation that can run on the device
(``data.augment``) run there. The result equals the step-by-step pipeline (full decode, then torch's
crops and antialiased resizes) up to the resize filter (tested). ``data.cache: memory`` keeps the
deterministic part of each image after the first epoch instead.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from brickyard.data.bundle import DataBundle, Split, held_out
from brickyard.data.idx import cache_dir
from brickyard.data.transforms import NAMED_STATS, Pipeline, random_crop_arg, to_channels
from brickyard.errors import ConfigError, DataError
from brickyard.files import printable, write_atomic

IMAGE_EXT = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
# What operating systems leave in a folder of photos, left out as hidden files are: Windows Explorer's thumbnail
# caches and folder settings (hidden by attribute there, not by a dot), and the folder of resource forks that
# macOS's Archive Utility puts in a zip (``__MACOSX``, beside the folders it holds)
LEFT_OUT_FILES = {"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini"}
LEFT_OUT_FOLDERS = {"__MACOSX"}


def _kept(name: str, folder: bool = False) -> bool:
    return not name.startswith(".") and (name not in LEFT_OUT_FOLDERS if folder else name.lower() not in LEFT_OUT_FILES)


GREY = ("L", "1", "I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # decoded to one channel
# what a file Pillow cannot decode raises: a truncated or foreign file, a decompression bomb (a small file
# whose header claims a huge image), a damaged stream; each is a bad image (``data.skip_bad_images``)
BAD_IMAGE = (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError, EOFError,
             MemoryError)


def why_bad(e: BaseException) -> str:
    """What a decode failure (one of ``BAD_IMAGE``) says in a sentence."""
    if isinstance(e, Image.DecompressionBombError):
        return "a decompression bomb: its header claims more pixels than Pillow decodes"
    return f"{type(e).__name__}: {str(e).strip()[:120]}"


def bad_image(path: Path, e: BaseException) -> DataError:
    return DataError(f"{printable(path)} is unreadable or truncated ({why_bad(e)}); fix or delete it, or set "
                     f"data.skip_bad_images: true.")


def as_uint8(im: Image.Image, mode: str) -> np.ndarray:
    """The pixels of ``im`` in ``mode`` (L or RGB) as uint8: 16-bit and 32-bit images scaled to 0-255
    (65535 -> 255, not clipped), float images taken as 0-1 when they lie there, else as 0-255."""
    if im.mode.startswith("I;16") or im.mode in ("I", "F"):
        a = np.asarray(im, dtype=np.float64)
        if im.mode == "F":
            a = a * 255 if np.nanmax(a, initial=0) <= 1.0 else a
        else:
            a = a / 257.0  # 16-bit range (PNG, TIFF); 32-bit "I" files hold 16-bit data in practice
        g = np.clip(np.nan_to_num(a), 0, 255).round().astype(np.uint8)
        return g if mode == "L" else np.repeat(g[..., None], 3, axis=2)
    return np.asarray(im if im.mode == mode else im.convert(mode), dtype=np.uint8)


def decode(path: Path) -> torch.Tensor:
    """uint8 C x H x W (1 channel for grayscale files, else 3); a clear error naming a bad file."""
    try:
        with Image.open(path) as im:
            arr = as_uint8(im, "L" if im.mode in GREY else "RGB").copy()
    except BAD_IMAGE as e:
        raise bad_image(path, e) from None
    t = torch.from_numpy(arr)
    return t[None] if t.dim() == 2 else t.permute(2, 0, 1).contiguous()


def files_under(top: Path) -> list[Path]:
    """The files under class folder ``top``, sorted, hidden files and folders left out (``.DS_Store``,
    Jupyter's ``.ipynb_checkpoints`` copies), and Windows' ``Thumbs.db`` and ``desktop.ini`` and macOS's
    ``__MACOSX`` (``LEFT_OUT_FILES``, ``LEFT_OUT_FOLDERS``). Links to folders are followed, as torchvision's ``ImageFolder``
    does (``make_dataset`` in ``torchvision/datasets/folder.py`` walks each class with ``os.walk(target_dir,
    followlinks=True)``), so a class assembled from linked folders is read whole whatever the Python version
    (``Path.rglob`` left them out), and each real folder is read once: a link back up the tree is not a loop."""
    seen, out = set(), []
    for root, dirs, names in os.walk(top, followlinks=True):
        try:
            st = os.stat(root)
        except OSError:  # gone while the tree was walked (a dangling link is a name, not a folder, to os.walk)
            dirs[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if _kept(d, folder=True))
        out += [Path(root) / n for n in names if _kept(n) and os.path.isfile(os.path.join(root, n))]
    return sorted(out)


def scan(folder: Path, classes: list[str] | None = None) -> tuple[list[Path], list[int], list[str]]:
    if not folder.is_dir():
        raise DataError(f"image folder {folder} does not exist.")
    found = sorted(d.name for d in folder.iterdir() if d.is_dir() and _kept(d.name, folder=True))
    if not found:
        raise DataError(f"{folder} has no class folders; expected {folder}/<class>/<image files>.")
    if classes is None:
        classes = found
    else:
        extra = [c for c in found if c not in classes]
        if extra:
            raise DataError(f"{folder} has class folder {extra[0]!r} that the training split lacks; classes are {', '.join(classes)}.")
    files, labels = [], []
    for label, name in enumerate(classes):
        d = folder / name
        if not d.is_dir():
            continue
        entries = files_under(d)
        for p in entries:
            if p.suffix.lower() not in IMAGE_EXT:
                raise DataError(f"{p} is not an image file (extension {p.suffix or 'none'}); images must be one of {', '.join(sorted(IMAGE_EXT))}.")
        if not entries:
            raise DataError(f"class folder {d} is empty.")
        files += entries
        labels += [label] * len(entries)
    return files, labels, classes


def read(path: Path, pipeline: Pipeline, rng=random) -> torch.Tensor:
    """The pipeline's output for the file at ``path`` (uint8 C x H x W), decoding only what it needs;
    random transforms draw from ``rng``."""
    try:
        with Image.open(path) as im:
            w, h = im.size
            plan = pipeline.plan(h, w, rng)
            if plan is None:
                return pipeline(decode(path), rng)
            (left, top, right, bottom), (oh, ow), _ = plan
            mode = "L" if im.mode in GREY else "RGB"
            if im.format == "JPEG":  # decode at the smallest built-in scale that still covers the output
                im.draft(mode, (max(1, math.ceil(w * ow / (right - left))), max(1, math.ceil(h * oh / (bottom - top)))))
            scale = (im.size[0] / w, im.size[1] / h)
            pixels = as_uint8(im, mode)  # decoded here; read-only when no conversion was needed
    except BAD_IMAGE as e:
        raise bad_image(path, e) from None
    return _resample(pixels, plan, scale, pipeline.channels)


def _resample(pixels: np.ndarray, plan, scale: tuple[float, float], channels: int) -> torch.Tensor:
    """The planned region of ``pixels`` (H x W or H x W x C uint8, whose pixels are ``scale`` times the
    original's), resized once by torch's antialiased bilinear filter on uint8: the filter of the
    step-by-step pipeline, and on CPUs with AVX2 about twice as fast as Pillow's. The region is rounded
    to whole pixels (at most half a source pixel off where a resize before a crop left it fractional)."""
    (left, top, right, bottom), (oh, ow), flip = plan
    sx, sy = scale
    height, width = pixels.shape[:2]
    x0, y0 = min(max(round(left * sx), 0), width - 1), min(max(round(top * sy), 0), height - 1)
    x1, y1 = min(max(round(right * sx), x0 + 1), width), min(max(round(bottom * sy), y0 + 1), height)
    with warnings.catch_warnings():  # never written to: the resize below makes a new tensor
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        region = torch.from_numpy(pixels)[y0:y1, x0:x1]
    region = region[None, None] if region.dim() == 2 else region.permute(2, 0, 1)[None]
    if (y1 - y0, x1 - x0) == (oh, ow):
        t = region[0].clone()
    else:
        t = torch.nn.functional.interpolate(region, size=(oh, ow), mode="bilinear", antialias=True, align_corners=False)[0]
    if flip:
        t = t.flip(-1)
    return to_channels(t.contiguous(), channels)


class DiskCache:
    """Every image of a split decoded once into one uint8 file (``<split>-<fingerprint>.u8``, pixels
    H x W x C one image after another) with an index (``.idx.npy``: offset, channels, height, width per
    image, then the fingerprint), memory-mapped by every later reader. The fingerprint covers the files'
    paths, sizes and modification times, so a changed folder gets a new cache; a cache whose index names
    other images, or whose pixel file is cut short, is one sentence. Written to a temporary name and
    renamed: processes that build it at once each write their own and the last rename wins."""

    def __init__(self, files: list[Path], root: Path, split: str):
        self.files = files
        stamp = hashlib.sha1()
        for f in files:
            st = f.stat()
            stamp.update(os.fsencode(f.relative_to(root)) + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        self.fingerprint = stamp.hexdigest()[:16]
        folder = root / ".brickyard-cache"
        if not os.access(root, os.W_OK):
            folder = cache_dir("imagefolder") / hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
        self.pixels = folder / f"{split}-{self.fingerprint}.u8"
        self.index_path = folder / f"{split}-{self.fingerprint}.idx.npy"
        if not (self.pixels.is_file() and self.index_path.is_file()):
            self._build()
        self._open()

    def _build(self) -> None:
        index = np.zeros((len(self.files) + 1, 4), dtype=np.int64)

        def write(out):
            offset = 0
            for i, f in enumerate(self.files):
                img = decode(f).permute(1, 2, 0).contiguous().numpy()  # H x W x C
                index[i] = (offset, img.shape[2], img.shape[0], img.shape[1])
                out.write(img.tobytes())
                offset += img.size
            index[-1] = (offset, len(self.files), int(self.fingerprint, 16) & (2**62 - 1), 0)

        write_atomic(self.pixels, write)
        write_atomic(self.index_path, lambda f: np.save(f, index))

    def _open(self) -> None:
        try:
            index = np.load(self.index_path)
            open(self.pixels, "rb").close()
        except PermissionError as e:
            raise DataError(f"image cache {e.filename or self.index_path} cannot be read: permission denied (another "
                            f"user's cache in a shared folder; ask them to make it readable, or point BRICKYARD_CACHE "
                            f"and a folder of your own at the images).") from None
        except (OSError, ValueError) as e:
            raise DataError(f"image cache index {self.index_path} cannot be read ({e}); delete it to rebuild the cache.") from None
        foreign = DataError(f"image cache index {self.index_path} is not one brickyard wrote for this folder's "
                            f"{len(self.files)} images; delete {self.pixels.parent} to rebuild it.")
        if index.ndim != 2 or index.shape[1] != 4 or len(index) < 2 or not np.issubdtype(index.dtype, np.integer):
            raise foreign
        total, n, stamp = (int(v) for v in index[-1][:3])
        if n != len(self.files) or stamp != int(self.fingerprint, 16) & (2**62 - 1):
            raise DataError(f"image cache {self.index_path} holds another data set's images ({n} images, not this "
                            f"folder's {len(self.files)}); delete {self.pixels.parent} to rebuild it.")
        if len(index) != n + 1 or not _laid_end_to_end(index):  # its last row names this folder, its others do not
            raise foreign
        if self.pixels.stat().st_size != total:
            raise DataError(f"image cache {self.pixels} is {self.pixels.stat().st_size:,} bytes, not the {total:,} its "
                            f"index lists: it was cut short; delete it to rebuild the cache.")
        self.index = index[:-1]
        self.mm = np.memmap(self.pixels, dtype=np.uint8, mode="r")

    def read(self, i: int, pipeline: Pipeline, rng=random) -> torch.Tensor:
        offset, c, h, w = (int(v) for v in self.index[i])
        arr = self.mm[offset:offset + c * h * w].reshape(h, w, c)
        plan = pipeline.plan(h, w, rng)
        if plan is None:
            return pipeline(torch.from_numpy(np.array(arr)).permute(2, 0, 1).contiguous(), rng)
        return _resample(arr, plan, (1.0, 1.0), pipeline.channels)



def _laid_end_to_end(index: np.ndarray) -> bool:
    """Each image's (offset, channels, height, width) starts where the one before ends, from 0 to the total in
    the last row, with 1, 3 or 4 channels and sides of at least one pixel: every read stays in the file."""
    rows = index[:-1]
    if len(rows) == 0 or not np.isin(rows[:, 1], (1, 3, 4)).all() or (rows[:, 2:] < 1).any() or (rows[:, 2:] > 1 << 20).any():
        return False
    ends = rows[:, 0] + rows[:, 1] * rows[:, 2] * rows[:, 3]
    return bool(rows[0, 0] == 0 and (rows[1:, 0] == ends[:-1]).all() and ends[-1] == index[-1, 0])


class ImageFolderDataset(torch.utils.data.Dataset):
    """Decoded with Pillow on read. With ``cache=True`` the deterministic part of the pipeline's
    output is kept in a shared-memory tensor that the DataLoader workers fill during the first
    epoch; later epochs read it from there and only apply the random transforms.

    A key is an index, or ``(index, seed)`` (the training loader's, ``seeded``): the random transforms
    then draw from a ``random.Random(seed)`` of their own, else from Python's ``random`` module."""

    seeded = True

    def __init__(self, files, labels, pipeline: Pipeline, cache: bool = False, disk: DiskCache | None = None):
        self.files, self.labels, self.pipeline, self.disk = files, labels, pipeline, disk
        self.cache = self.filled = None
        if cache:
            if pipeline.fixed_size is None:
                raise ConfigError("data.cache: memory needs transforms that reach a fixed size before any random one "
                                  "(start with resize:HxW or center_crop:S).")
            h, w = pipeline.fixed_size
            self.cache = torch.zeros((len(files), pipeline.channels, h, w), dtype=torch.uint8).share_memory_()
            self.filled = torch.zeros(len(files), dtype=torch.bool).share_memory_()

    def __len__(self):
        return len(self.files)

    def __getitem__(self, key):
        i, rng = (key[0], random.Random(key[1])) if isinstance(key, tuple) else (key, random)
        if self.disk is not None:
            return self.disk.read(i, self.pipeline, rng), self.labels[i]
        if self.cache is None:
            return read(self.files[i], self.pipeline, rng), self.labels[i]
        if self.filled[i]:
            img = self.cache[i]
        else:
            img = self.pipeline.first(decode(self.files[i]))
            if self.cache is not None:
                self.cache[i] = img
                self.filled[i] = True
        return self.pipeline.rest(img, rng), self.labels[i]


def _drop_bad(files, labels):
    good_f, good_l, bad = [], [], []
    for f, l in zip(files, labels):
        try:
            decode(f)
            good_f.append(f)
            good_l.append(l)
        except DataError:
            bad.append(f)
    if bad:
        warnings.warn(f"skipped {len(bad)} unreadable image file(s) (first: {bad[0]})", stacklevel=2)
    return good_f, good_l, bad


SMALL = 64  # images no larger than this on either side are trained at their own size by default


def auto_transforms(cfg, first: torch.Tensor):
    """``auto`` transforms follow the images: small ones (digits, icons, CIFAR-sized) keep their own size,
    photos get the 224 pipeline (random resized crop and flip; resize 256, centre crop 224)."""
    h, w = first.shape[-2:]
    small = max(h, w) <= SMALL
    train, ev = cfg.train_transforms, cfg.eval_transforms
    if tuple(train) == ("auto",):
        train = (f"resize:{h}x{w}",) if small else ("random_resized_crop:224", "hflip")
    if tuple(ev) == ("auto",):
        ev = (f"resize:{h}x{w}",) if small else ("resize:256", "center_crop:224")
    return dataclasses.replace(cfg, train_transforms=tuple(train), eval_transforms=tuple(ev))


class _Splits:
    """The splits of the image folder at ``root``: class folders (``scan``), or images tagged by CSV files
    (``data.tagged``, whose training split decides ``task``, one label an image or several)."""

    def __init__(self, root: Path, task: str):
        from brickyard.data import tagged  # it reads folders with this module's files_under
        self.root, self.csv = root, tagged if tagged.tagged(root) else None
        self.task = task if self.csv else "single"

    def has(self, split: str) -> bool:
        if self.csv is None:
            return (self.root / split).is_dir()
        return (self.root / self.csv.SPLIT_CSV.format(split=split)).is_file()

    def read(self, split: str, classes: list[str] | None = None) -> tuple[list[Path], list, list[str]]:
        if self.csv is None:
            return scan(self.root / split, classes)
        files, labels, vocab, self.task = self.csv.split_of(self.root, split, classes, self.task)
        return files, labels, vocab


def imagefolder_bundle(cfg, channels: int) -> DataBundle:
    if not cfg.root:
        raise ConfigError("data.root: an image-folder data set needs data.root, the folder holding train/ and test/.")
    root = Path(cfg.root).expanduser()
    splits = _Splits(root, cfg.task)
    files, labels, classes = splits.read("train")
    skipped = []
    if cfg.skip_bad_images:  # before the first image is probed for the size: it may be a bad one
        files, labels, skipped = _drop_bad(files, labels)
        if not files:
            raise DataError(f"{root / 'train'}: no readable image (all {len(skipped)} skipped as bad).")
    first = decode(files[0])
    channels = channels or first.shape[0]
    cfg = auto_transforms(cfg, first)
    size, train_size = output_sizes(cfg, first)
    train_pipe = Pipeline(cfg.train_transforms, channels)
    eval_pipe = Pipeline(cfg.eval_transforms, channels)

    def split(name: str) -> Split:
        f, l, _ = splits.read(name, classes)
        if cfg.skip_bad_images:
            f, l, more = _drop_bad(f, l)
            skipped.extend(more)
        return Split(dataset=ImageFolderDataset(f, l, eval_pipe))
    val = None
    if cfg.folds:  # the training and validation images pooled, one fold validates (data.folds)
        files, labels, val = _fold(files, labels, split("val") if splits.has("val") else None, cfg, eval_pipe)
    elif splits.has("val") and not cfg.train_on_all:
        val = split("val")
    elif cfg.val_fraction > 0:
        vidx, tidx = held_out(len(files), cfg.val_fraction)
        val = Split(dataset=ImageFolderDataset([files[i] for i in vidx], [labels[i] for i in vidx], eval_pipe))
        files, labels = [files[i] for i in tidx], [labels[i] for i in tidx]
    test = split("test") if splits.has("test") else None
    mean, std = NAMED_STATS[cfg.normalize]
    if channels == 1:
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    disk = DiskCache(files, root, "train") if cfg.cache == "disk" else None
    train = ImageFolderDataset(files, labels, train_pipe, cache=cfg.cache == "memory", disk=disk)
    return DataBundle("imagefolder", Split(dataset=train), val, test,
                      len(classes), channels, size, tuple(mean), tuple(std), classes,
                      train_size=train_size if train_size != size else None, multilabel=splits.task == "multilabel",
                      notes=[f"labels from {root / 'train.csv'} (image,tags)"] if splits.csv else [])


def _fold(files, labels, val: Split | None, cfg, eval_pipe) -> tuple[list, list, Split]:
    """``data.folds`` of an image folder: its training and validation files pooled and cut (``data.folds``)."""
    from brickyard.data.folds import fold_indices  # cross-validation runs only
    if val is not None and isinstance(val.dataset, ImageFolderDataset):
        files, labels = files + val.dataset.files, labels + val.dataset.labels
    single = all(isinstance(v, int) for v in labels)
    train, held = fold_indices(len(files), cfg.folds, cfg.fold, torch.tensor(labels) if single else None)
    pick = lambda idx, seq: [seq[i] for i in idx.tolist()]  # noqa: E731
    return pick(train, files), pick(train, labels), Split(dataset=ImageFolderDataset(pick(held, files), pick(held, labels), eval_pipe))


def output_sizes(cfg, first: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """(evaluation size, training size) of the transforms in ``cfg`` (the data config, ``auto`` resolved);
    one sentence where either does not end in a fixed size. ``first``: the first training image."""
    size = _output_size(cfg.eval_transforms)
    if size is None:
        raise ConfigError("data.eval_transforms must end in a fixed size (center_crop:S or resize:HxW) so images batch "
                          "together.")
    train_size = _output_size(cfg.train_transforms)
    if train_size is None:
        raise ConfigError(f"data.train_transforms must end in a fixed size (random_resized_crop:S, random_crop:S, center_crop:S or "
                          f"resize:HxW) so images batch together, e.g. resize:{first.shape[1]}x{first.shape[2]} (the first "
                          f"image's size).")
    return size, train_size


def _output_size(transforms) -> tuple[int, int] | None:
    """The image size a pipeline produces (its last crop, or resize to HxW); None: each image's own
    (no size step, or a last resize of the shorter side)."""
    for spec in reversed(list(transforms)):
        name, _, arg = str(spec).partition(":")
        if name == "random_crop":
            return random_crop_arg(arg)[0]
        if name in ("center_crop", "random_resized_crop") or (name == "resize" and "x" in arg):
            return (int(arg), int(arg)) if "x" not in arg else tuple(int(v) for v in arg.split("x"))
        if name == "resize":
            return None
    return None
