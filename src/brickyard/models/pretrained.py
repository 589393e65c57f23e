"""Published weights by name: ``finetune.init_from: torchvision:resnet50`` (and ``resnet18``, ``vgg16``).

The files are torchvision's ImageNet weights (``IMAGENET1K_V1``), fetched from the URLs torchvision
publishes them at (``torchvision/models/resnet.py`` and ``vgg.py``) through ``torch.hub``'s
``download_url_to_file`` with its hash check: the hex digits after the last ``-`` of each file name are
the start of the file's SHA-256, and a download that does not match is deleted, not kept. The files
go to brickyard's cache (``$BRICKYARD_CACHE/weights``, default ``~/.cache/brickyard/weights``); a file
placed there by hand (a machine without internet) is used as it is. brickyard's ``resnet18_imagenet``,
``resnet50`` and ``vgg16`` use torchvision's key names, so the weights load unchanged.
``BRICKYARD_WEIGHTS_URL`` replaces the folder the files are fetched from (a mirror).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from brickyard.data.idx import cache_dir
from brickyard.errors import CheckpointError

BASE = "https://download.pytorch.org/models/"
# name -> (brickyard's model of that layout, torchvision's file for IMAGENET1K_V1)
PUBLISHED = {
    "resnet18": ("resnet18_imagenet", "resnet18-f37072fd.pth"),
    "resnet50": ("resnet50", "resnet50-0676ba61.pth"),
    "vgg16": ("vgg16", "vgg16-397923af.pth"),
}
PREFIX = "torchvision:"


def is_named(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def model_for(spec: str) -> str:
    return PUBLISHED[_name(spec)][0]


def _name(spec: str) -> str:
    name = spec[len(PREFIX):]
    if name not in PUBLISHED:
        raise CheckpointError(f"finetune.init_from: {spec!r} names no published weights; known: "
                              f"{', '.join(PREFIX + n for n in PUBLISHED)}.")
    return name


def fetch(spec: str) -> Path:
    """The local file of ``spec``'s weights, downloaded and hash-checked the first time."""
    name = _name(spec)
    file = PUBLISHED[name][1]
    folder = cache_dir("weights")
    path = folder / file
    if path.is_file():
        return path
    url = os.environ.get("BRICKYARD_WEIGHTS_URL", BASE).rstrip("/") + "/" + file
    folder.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(url, str(path), hash_prefix=file.rsplit("-", 1)[1].split(".")[0], progress=False)
    except RuntimeError as e:  # torch.hub: 'invalid hash value (expected "...", got "...")'
        path.unlink(missing_ok=True)
        raise CheckpointError(f"the file at {url} is not {spec}'s published weights ({str(e).strip()}); nothing was "
                              f"kept: download it again, or place the right file as {path}.") from None
    except OSError as e:
        path.unlink(missing_ok=True)
        reason = f"HTTP {e.code} {e.reason}" if hasattr(e, "code") else getattr(e, "reason", None) or e
        raise CheckpointError(f"cannot download {spec} weights from {url} ({reason}); on a machine without internet, "
                              f"download that file elsewhere and place it as {path}.") from None
    return path
