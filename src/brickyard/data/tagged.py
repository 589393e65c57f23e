"""Image folders tagged by a CSV: ``ROOT/train.csv`` (and ``val.csv``, ``test.csv``) of ``image,tags``.

The layout of Kaggle's Planet data and of fastai's ``ImageDataLoaders.from_csv(path, label_delim=' ')``: a header
line, then one line an image, its first column the image's file name (relative to ``ROOT/<split>/``, or to ``ROOT``
where that folder does not exist; the extension may be left out, as Planet's ``train_0`` names ``train_0.jpg``),
its second the image's tags separated by spaces (further columns are not read). The tags are the training CSV's,
sorted; each label is a multi-hot row of them (several labels an image, ``data.task: multilabel``). Where
``data.task`` is ``auto`` and every line holds exactly one tag (``id,breed`` as in Kaggle's dog breeds), the tags
are classes and each label is one class index (``data.task: single``).

Read as from a stranger: a line naming an image the folder lacks, two lines naming one image, a header missing
(the first line names an image) or a line of one column are one sentence each; an image with no tags (a
negative for every tag), a tag only the validation or test CSV holds (not scored: no output predicts it) and
images of the folder that no line names (left out) are counted warnings.
"""
from __future__ import annotations

import csv
import warnings
from pathlib import Path

import torch

from brickyard.data.imagefolder import IMAGE_EXT, files_under
from brickyard.errors import DataError

SPLIT_CSV = "{split}.csv"


def tagged(root: Path) -> bool:
    """Whether ``root`` is an image folder tagged by CSV files (it holds ``train.csv``)."""
    return (root / SPLIT_CSV.format(split="train")).is_file()


def _lines(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-blank line of the CSV at ``path``; an unreadable file is one sentence."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
            return [(n, row) for n, row in enumerate(csv.reader(f), 1) if any(v.strip() for v in row)]
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; save it as a UTF-8 CSV (image,tags).") from None
    except (OSError, csv.Error) as e:
        raise DataError(f"{path} cannot be read as a CSV ({e}).") from None


def _finder(folder: Path):
    """Image lookup by a CSV's name for it: the path under ``folder``, with or without its extension."""
    exact: dict[str, Path] = {}
    stems: dict[str, list[Path]] = {}
    for p in files_under(folder) if folder.is_dir() else []:
        rel = p.relative_to(folder).as_posix()
        exact[rel] = p
        stems.setdefault(rel[: -len(p.suffix)] if p.suffix else rel, []).append(p)

    def find(name: str) -> Path | None | list[Path]:
        name = name.strip()
        name = name[2:] if name.startswith("./") else name
        return exact.get(name) or (stems.get(name, [None])[0] if len(stems.get(name, [])) <= 1 else stems[name])
    return find, exact


def read_split(root: Path, split: str, vocab: list[str] | None = None):
    """``(files, tag lists)`` of ``split`` from ``ROOT/<split>.csv``; ``vocab``: the training tags (a tag not among
    them is dropped, counted in a warning)."""
    path = root / SPLIT_CSV.format(split=split)
    folder = root / split if (root / split).is_dir() else root
    find, listed = _finder(folder)
    lines = _lines(path)
    if not lines:
        raise DataError(f"{path} is empty; its first line is the header image,tags, then one line an image.")
    (_, header), rows = lines[0], lines[1:]
    if len(header) < 2:
        raise DataError(f"{path}: the header {','.join(header)!r} has one column; a line is an image's file name and "
                        f"its tags separated by spaces, comma-separated: image,tags.")
    if find(header[0]) is not None or Path(header[0].strip()).suffix.lower() in IMAGE_EXT:
        raise DataError(f"{path}: the first line names an image ({header[0].strip()!r}), and it is the header's place; "
                        f"add the line image,tags above it.")
    files, tags, missing, seen = [], [], [], {}
    for n, row in rows:
        if len(row) < 2:
            raise DataError(f"{path} line {n} has one column ({row[0]!r}); each line is an image and its tags: "
                            f"image,tags (an image without tags: image, with nothing after the comma).")
        found = find(row[0])
        if isinstance(found, list):
            raise DataError(f"{path} line {n}: {row[0].strip()!r} matches {len(found)} files in {folder} "
                            f"({', '.join(p.name for p in found[:3])}); name it with its extension.")
        if found is None:
            missing.append((n, row[0].strip()))
            continue
        if found.suffix.lower() not in IMAGE_EXT:
            raise DataError(f"{path} line {n}: {found} is not an image file (extension {found.suffix or 'none'}); "
                            f"images must be one of {', '.join(sorted(IMAGE_EXT))}.")
        if found in seen:
            raise DataError(f"{path} lines {seen[found]} and {n} both name {row[0].strip()!r}; list each image once.")
        seen[found] = n
        files.append(found)
        tags.append(sorted(set(row[1].split())))
    if missing:
        n, name = missing[0]
        raise DataError(f"{path} names {len(missing):,} image(s) that {folder} does not hold (first: line {n}, "
                        f"{name!r}).")
    _warn(path, folder, split, files, tags, vocab, listed if folder != root else {})
    if vocab is not None:
        tags = [[t for t in ts if t in vocab] for ts in tags]
    return files, tags


def _warn(path, folder, split, files, tags, vocab, listed) -> None:
    """The counted warnings of the module docstring."""
    untagged = sum(1 for ts in tags if not ts)
    if untagged:
        warnings.warn(f"{path}: {untagged:,} image(s) have no tags (first: {files[tags.index([])].name}); they teach "
                      f"every tag's absence.", stacklevel=3)
    if vocab is not None:
        unknown = sorted({t for ts in tags for t in ts} - set(vocab))
        if unknown:
            lines = sum(1 for ts in tags if set(ts) - set(vocab))
            warnings.warn(f"{path}: {len(unknown)} tag(s) only the {split} split has ({', '.join(unknown[:5])}"
                          f"{', ...' if len(unknown) > 5 else ''}), on {lines:,} image(s); no output predicts them, "
                          f"so they are not scored.", stacklevel=3)
    named = set(files)
    left = [p for p in listed.values() if p.suffix.lower() in IMAGE_EXT and p not in named]
    if left:
        warnings.warn(f"{folder}: {len(left):,} image(s) that {path.name} does not list are left out (first: "
                      f"{left[0].name}).", stacklevel=3)


def task_of(path: Path, tags: list[list[str]], task: str) -> str:
    """``single`` or ``multilabel`` for the training tags under ``data.task`` (module docstring): auto is single
    where every image has exactly one tag; single with an image of none or several is one sentence."""
    if task == "multilabel" or task == "auto" and any(len(ts) != 1 for ts in tags):
        return "multilabel"
    bad = next((i for i, ts in enumerate(tags) if len(ts) != 1), None)
    if bad is not None:
        raise DataError(f"data.task: single takes one tag an image, and image {bad + 1:,} of {path} has "
                        f"{len(tags[bad])}; use data.task: multilabel or auto.")
    return "single"


def split_of(root: Path, split: str, vocab: list[str] | None, task: str):
    """``(files, labels, vocab, task)`` of ``split``; ``vocab`` and ``task`` None: the training split, which sets them.
    A label is a class index (one label an image) or a multi-hot float row over ``vocab``. A validation or test
    image whose one tag training never saw is left out (one label an image; counted in the warning)."""
    files, tags = read_split(root, split, vocab)
    if vocab is None:
        vocab = sorted({t for ts in tags for t in ts})
        if not vocab:
            raise DataError(f"{root / SPLIT_CSV.format(split=split)} gives no image a tag; there is nothing to learn.")
        task = task_of(root / SPLIT_CSV.format(split=split), tags, task)
    index = {t: i for i, t in enumerate(vocab)}
    if task == "single":
        task_of(root / SPLIT_CSV.format(split=split), [ts for ts in tags if ts], "single")
        kept = [i for i, ts in enumerate(tags) if ts]
        return [files[i] for i in kept], [index[tags[i][0]] for i in kept], vocab, task
    rows = torch.zeros(len(tags), len(vocab))
    for i, ts in enumerate(tags):
        rows[i, [index[t] for t in ts]] = 1.0
    return files, list(rows), vocab, task
