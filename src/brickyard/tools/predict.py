"""Inference with several outputs: predicted class, probabilities and any named layers' outputs.

Inputs are image files (PNG/JPEG, converted to the model's channels and size with Pillow), an
``.npy`` array, or tensors. uint8 values are scaled by 1/255, float values are taken as 0..1
intensities; both are then normalised with the training mean/std saved in the checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from brickyard.config.checks import TTA
from brickyard.data import _input_dtypes, layout
from brickyard.data.augment import DevicePrep, float_dtype
from brickyard.data.bundle import Split
from brickyard.data.imagefolder import BAD_IMAGE, GREY, IMAGE_EXT, as_uint8, files_under, why_bad
from brickyard.errors import BrickyardError, DataError, reason
from brickyard.files import printable, write_atomic
from brickyard.observe.inspection import forward_with_outputs
from brickyard.tools.export import is_exported, load_exported
from brickyard.training import checkpoint as ckpt
from brickyard.training import device as dev
from brickyard.training.evaluation import tta_logits

CHUNK = 256  # inputs through the model at once: a folder of thousands of photos is not one batch


def _expanded(paths) -> list[tuple[Path, str]]:
    """``paths`` with their names, each folder replaced by the image files under it (sorted, hidden ones left
    out, links followed as an image folder's are; named by their path inside it), so a test folder is one
    argument."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = [f for f in files_under(p) if f.suffix.lower() in IMAGE_EXT]
            if not found:
                raise DataError(f"input folder {printable(p)} holds no image files ({', '.join(sorted(IMAGE_EXT))}).")
            out += [(f, os.path.relpath(f, p)) for f in found]
        else:
            out.append((p, p.name))
    return out


def load_inputs(paths, in_channels: int, image_size) -> tuple[torch.Tensor, list[str]]:
    tensors, names = [], []
    for p, name in _expanded(paths):
        if not p.is_file():
            raise DataError(f"input {p} does not exist.")
        if p.suffix.lower() == ".npy":
            try:
                arr = np.load(p, allow_pickle=False)
            except ValueError as e:
                raise DataError(f"{p} is not a plain .npy array ({e}).") from None
            t = torch.from_numpy(np.ascontiguousarray(arr))
            if t.dim() == 2:
                t = t[None, None]
            elif t.dim() == 3 and in_channels > 1 and t.shape[2] == in_channels and t.shape[0] != in_channels:
                t = t.permute(2, 0, 1)[None]  # one H x W x C image
            elif t.dim() == 3:
                t = t.unsqueeze(1) if in_channels == 1 or t.shape[0] != in_channels else t[None]
            if t.dim() == 4 and t.shape[1] != in_channels and t.shape[3] == in_channels:
                t = layout.channels_first(t)  # N x H x W x C, as NumPy keeps images (refused below otherwise)
            if t.dim() != 4 or t.shape[1] != in_channels:
                raise DataError(f"{p}: array of shape {tuple(arr.shape)} does not give N x {in_channels} x H x W images.")
            t = _resize(t, image_size)
            tensors.append(t)
            names += [f"{name}[{i}]" for i in range(len(t))]
        else:
            tensors.append(_read_image(p, in_channels, image_size)[None])
            names.append(name)
    if not tensors:
        raise DataError("no inputs given.")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        tensors = [t.float() / 255 if t.dtype == torch.uint8 else t.float() for t in tensors]
    return torch.cat(tensors), names


def _read_image(path: Path, in_channels: int, image_size) -> torch.Tensor:
    try:
        with Image.open(path) as im:
            pixels = as_uint8(im, "L" if im.mode in GREY else "RGB")  # 16-bit and float files scaled, not clipped
        im = Image.fromarray(pixels).convert("L" if in_channels == 1 else "RGB")
        arr = np.asarray(im.resize((image_size[1], image_size[0]), Image.BILINEAR), dtype=np.uint8)
    except BAD_IMAGE as e:
        raise DataError(f"{printable(path)} is not a readable image ({why_bad(e)}).") from None
    t = torch.from_numpy(arr.copy())
    return t[None] if t.dim() == 2 else t.permute(2, 0, 1)


def _resize(t: torch.Tensor, image_size) -> torch.Tensor:
    if tuple(t.shape[-2:]) == tuple(image_size):
        return t
    dtype = t.dtype
    out = torch.nn.functional.interpolate(t.float(), size=tuple(image_size), mode="bilinear", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8) if dtype == torch.uint8 else out


def _as_batch(inputs, meta: dict) -> torch.Tensor:
    """``inputs`` as one tensor: image or ``.npy`` paths (one, or a list) read as the CLI reads them, a list
    of same-shaped tensors stacked, an array as it is."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(i, (str, Path)) for i in inputs):
        return load_inputs(inputs, meta.get("in_channels", 1), meta.get("image_size", (28, 28)))[0]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(i, torch.Tensor) for i in inputs):
        if len({tuple(i.shape) for i in inputs}) > 1:
            raise BrickyardError("inputs: the tensors in the list differ in shape; give one size (or image files).")
        return torch.stack(list(inputs))
    if not (isinstance(inputs, (torch.Tensor, list, tuple)) or hasattr(inputs, "__array__")):  # nested lists too
        raise BrickyardError(f"inputs: expected a tensor or array N x C x H x W, a list of tensors, or image paths; "
                             f"got {type(inputs).__name__}.")
    try:
        return torch.as_tensor(np.asarray(inputs) if not isinstance(inputs, torch.Tensor) else inputs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BrickyardError(f"inputs: cannot be read as a tensor ({reason(e)}).") from None


def _as_fit_reads(x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A module's inputs as ``fit`` trains on its tensors: ``brickyard.data._input_dtypes`` (images of another integer
    type whose values all lie in 0..255 read as bytes, other integer images, floats and boolean images cast to the
    model's float dtype, other integers such as token ids left alone), then ``DevicePrep`` as for a batch of a user's
    data (mean 0, std 1, no augmentation): bytes scaled to [0, 1], floats and booleans cast. Before, bytes reached
    the module as 0..255 floats although ``fit`` had trained it on [0, 1]."""
    held = Split(x)
    _input_dtypes([held], model)
    return DevicePrep((0.0,), (1.0,), float_dtype=float_dtype(model))(held.images)


def _prepared(x: torch.Tensor, meta: dict, model) -> torch.Tensor:
    """The batch as the model reads it: with ``meta`` (a checkpoint's or an export's) in its layout and size, scaled
    and normalised (an exported program normalises itself); without, as ``fit`` reads a module's tensors."""
    if meta:  # N x H x W x C, as Keras and NumPy keep images: the checkpoint's C x H x W says it
        x = layout.as_checkpoint_reads(x, meta.get("in_channels"), meta.get("image_size"))
    else:  # a module: the dtype and layout it takes, as fit reads its tensors
        x = _as_fit_reads(x, model)
        if layout.model_reads_channels_last(model, x):
            x = layout.channels_first(x)
    if meta and x.dim() == 4 and meta.get("in_channels") and meta.get("image_size") \
            and tuple(x.shape[1:]) != (meta["in_channels"], *meta["image_size"]):
        c, (h, w) = meta["in_channels"], meta["image_size"]
        raise BrickyardError(f"inputs are {'x'.join(map(str, x.shape[1:]))} images and the model reads {c}x{h}x{w}; "
                             f"give image files (resized for you) or tensors of that size.")
    if meta:
        xf = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        if meta.get("normalises"):  # an exported program normalises itself
            x = xf
        else:
            mean = torch.tensor(meta["mean"]).view(1, -1, 1, 1)
            std = torch.tensor(meta["std"]).view(1, -1, 1, 1)
            x = (xf - mean) / std
    return x


def _source(model_or_checkpoint, outputs, trust_code: bool) -> tuple[torch.nn.Module, dict, int]:
    """(model, its metadata, the pixels flip-shift moves) of what ``predict`` was given."""
    if isinstance(model_or_checkpoint, torch.nn.Module):
        return model_or_checkpoint, {}, 1
    if is_exported(model_or_checkpoint):
        model, meta = load_exported(model_or_checkpoint, trust_code)
        if outputs and meta.get("normalises"):
            raise BrickyardError(f"{model_or_checkpoint} is a traced program: layer outputs need the checkpoint or a "
                                 f"safetensors export.")
        return model, meta, 1
    model, state, cfg = ckpt.load_model(model_or_checkpoint)
    return model, state.get("meta", {}), cfg.data.shift or 1


def _scored(logits: torch.Tensor, meta: dict, source, calibrated: bool) -> dict:
    """One label an image: the class and its softmax (over the logits divided by the kept temperature when
    ``calibrated``); several: each tag's sigmoid and the tags at or above the kept threshold (a multi-hot row)."""
    if meta.get("task") == "multilabel":
        p = logits.sigmoid()
        return {"predicted": (p >= ckpt.threshold({"meta": meta}, source)).long(), "probabilities": p, "logits": logits}
    t = ckpt.temperature({"meta": meta}, source) if calibrated else 1.0
    return {"predicted": logits.argmax(1), "probabilities": (logits / t).softmax(1), "logits": logits}


def predict(model_or_checkpoint, inputs, outputs=(), device: str | None = None, trust_code: bool = False,
            tta: str = "none", calibrated: bool = True) -> dict[str, torch.Tensor]:
    """``{"predicted", "probabilities", "logits", <layer>: tensor, ...}`` for a batch of inputs.

    ``model_or_checkpoint``: a checkpoint or run directory, an exported file (``brickyard export``), or an
    ``nn.Module`` (then inputs are read as ``fit`` reads its tensors, unnormalised: bytes, and integer images of
    0..255, scaled to [0, 1]; floats and booleans in the module's float dtype; other integers, such as token ids, as
    they are; a channels-last batch the module cannot take as it is, and can channels-first, read that way).
    ``inputs``: a tensor / array N x C x H x W (or N x H x W x C, Keras's layout, where the model takes
    only N x C x H x W, as ``fit`` reads it: ``brickyard.data.layout``), a list of tensors, or image / ``.npy`` paths.
    ``trust_code``: load a TorchScript or ``.pt2`` program, which can run code it brings (refused without).
    ``tta``: test-time augmentation (``data.tta``'s choices; flip-shift moves the checkpoint's ``data.shift``
    pixels, or 1): the logits are the log of the views' mean probabilities, as ``brickyard eval`` scores them.
    ``calibrated``: the probabilities of the logits divided by the temperature a checkpoint (or a safetensors export of
    it) keeps (``train.calibrate``); False, or a model without one: of the raw logits, which are returned as they are.
    ``device``: where to run (default: an ``nn.Module``'s own device, else the CPU). A module given is
    left as it was found: on its device, in its train or eval mode (a callback may call this on
    ``run.model`` in the middle of training).
    """
    model, meta, shift = _source(model_or_checkpoint, outputs, trust_code)
    if isinstance(outputs, str):
        outputs = [o for o in outputs.split(",") if o]  # "conv1,fc" as the CLI's --outputs, not its characters
    if tta not in TTA:
        raise BrickyardError(f"tta: {tta!r} is not one of {', '.join(TTA)}.")
    if tta != "none" and meta.get("task") == "multilabel":
        raise BrickyardError(f"tta: {tta} averages the class probabilities of one label an image; this model tags "
                             f"several (data.task: multilabel): predict without it.")
    if tta != "none" and (outputs or meta.get("normalises")):
        why = "layer outputs are of one view" if outputs else "an exported program normalises its own inputs"
        raise BrickyardError(f"tta: {tta} averages several views of each image, and {why}; predict without it.")
    x = _prepared(_as_batch(inputs, meta), meta, model)
    own = next((p.device for p in model.parameters()), None) if isinstance(model_or_checkpoint, torch.nn.Module) else None
    d = dev.resolve_device(device) if device is not None else (own or torch.device("cpu"))
    was_training = model.training
    if own is None or own != d:
        model = model.to(d)
    if not meta.get("normalises"):  # an exported program was traced in eval mode and cannot switch
        model.eval()
    try:
        with torch.no_grad() if tta != "none" else contextlib.nullcontext():
            parts = [forward_with_outputs(model, chunk.to(d), list(outputs)) if tta == "none"
                     else {"logits": tta_logits(model, chunk.to(d), tta, shift)} for chunk in x.split(CHUNK)]
        result = {k: torch.cat([part[k].cpu() for part in parts]) for k in parts[0]}
    finally:
        if was_training and not meta.get("normalises"):
            model.train()
        if own is not None and own != d:
            model.to(own)
    logits = result["logits"].float()
    out = _scored(logits, meta, model_or_checkpoint, calibrated)
    out.update({k: v.cpu() for k, v in result.items() if k != "logits"})
    out["classes"] = meta.get("classes", [])
    return out


def write(result: dict, names: list[str], outputs, fmt: str, out: Path | None) -> str | None:
    classes = result.pop("classes", [])
    if fmt == "npz":
        if out is None:
            raise BrickyardError("--format npz needs --out FILE.npz.")
        write_atomic(out, lambda f: np.savez(f, inputs=np.array(names), **{k: v.numpy() for k, v in result.items()}))
        return None
    def name(i: int) -> str:
        return classes[i] if i < len(classes) else str(i)
    predicted = result["predicted"]
    picked: list = predicted.tolist()
    named: list = [name(i) for i in picked] if predicted.dim() == 1 else []
    if predicted.dim() == 2:  # several labels an image: each image's tags at or above the threshold
        picked = [row.nonzero().flatten().tolist() for row in predicted]
        named = [[name(i) for i in tags] for tags in picked]
    doc = {
        "inputs": names,
        "predicted": picked,
        "predicted_names": named,
        "probabilities": [[round(p, 6) for p in row] for row in result["probabilities"].tolist()],
        "outputs": {k: {"shape": list(result[k].shape), "data": result[k].tolist()} for k in outputs},
    }
    text = json.dumps(doc)
    if out is not None:
        write_atomic(out, text + "\n")
        return None
    return text
