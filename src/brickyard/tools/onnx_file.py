"""An ONNX file from ``brickyard export --format onnx``, checked before use and run by onnxruntime.

What ``predict`` relies on is checked when the file is opened, each failure one sentence naming the file:
one input ``images`` of floats with four dimensions (N x C x H x W; sizes a number of at least 1 or a
name, as the exporter's dynamic batch axis is), whose declared C x H x W, where numbers, is the
metadata's ``in_channels`` x ``image_size``; an output ``logits`` of two dimensions. A model that passes
and still fails in onnxruntime (an operator that refuses the batch; a size onnxruntime shows as unknown,
such as a negative one) is one sentence too, at the run, as are logits that are not one row an input.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from brickyard.errors import BrickyardError, reason

META = "brickyard.json"  # the metadata_props key brickyard's export writes its metadata under


def _size(dim) -> str:
    return str(dim) if isinstance(dim, int) else "?"


def _declared(path: Path, arg, want: tuple[int, ...]) -> None:
    """The input ``arg`` against ``want`` (C, H, W from the metadata)."""
    if arg.type != "tensor(float)":
        raise BrickyardError(f"{path}: its input 'images' holds {arg.type}, not float images; export it again with "
                             "`brickyard export RUN --format onnx`.")
    shape = list(arg.shape or [])
    if len(shape) != 4:
        raise BrickyardError(f"{path}: its input 'images' has {len(shape)} dimension(s) "
                             f"({' x '.join(map(_size, shape)) or 'none'}); brickyard's ONNX files take N x C x H x W.")
    if any(isinstance(d, int) and d < 1 for d in shape):
        raise BrickyardError(f"{path}: its input 'images' declares a size below 1 ({' x '.join(map(_size, shape))}); "
                             "every size is a number of at least 1 or a name.")
    declared = tuple(shape[1:])
    if any(isinstance(d, int) and d != w for d, w in zip(declared, want)):
        raise BrickyardError(f"{path}: its input 'images' is declared {'x'.join(map(_size, declared))} and its metadata "
                             f"says {'x'.join(map(str, want))}; the file was changed after export, export it again.")


def check_session(path: Path, session, meta: dict) -> None:
    """``session``'s inputs and outputs against ``meta`` (module docstring)."""
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if [i.name for i in inputs] != ["images"] or "logits" not in [o.name for o in outputs]:
        raise BrickyardError(f"{path}: takes {', '.join(i.name for i in inputs) or 'no input'} and gives "
                             f"{', '.join(o.name for o in outputs) or 'no output'}; brickyard's ONNX files take one "
                             "input 'images' and give 'logits'.")
    _declared(path, inputs[0], (meta["in_channels"], *meta["image_size"]))
    logits = next(o for o in outputs if o.name == "logits")
    if len(logits.shape or []) != 2:
        raise BrickyardError(f"{path}: its output 'logits' has {len(logits.shape or [])} dimension(s); "
                             "brickyard's ONNX files give N x classes.")


class OnnxModel(nn.Module):
    """An exported ONNX file run by onnxruntime, called like the program it was exported from. ``meta`` is
    the file's metadata as read (empty without brickyard's); ``check(meta)`` then checks the graph."""

    def __init__(self, path: Path):
        super().__init__()
        try:  # optional dependency
            import onnxruntime as ort
        except ImportError:
            raise BrickyardError(f"{path}: running an ONNX model needs onnxruntime: pip install 'brickyard[onnx]'.") from None
        self.path = Path(path)
        self.runtime = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        props = self.runtime.get_modelmeta().custom_metadata_map
        self.meta = json.loads(props.get(META, "{}"))
        self.eval()

    def check(self) -> None:
        check_session(self.path, self.runtime, self.meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits N x classes for ``x`` (N x C x H x W); logits of another shape are one sentence, not a
        prediction for some of the inputs."""
        try:
            out = self.runtime.run(["logits"], {"images": x.detach().float().cpu().numpy()})[0]
        except Exception as e:  # noqa: BLE001  onnxruntime's errors come as its own types, one per failure kind
            raise BrickyardError(f"{self.path}: onnxruntime could not run the model on a batch of "
                                 f"{'x'.join(map(str, x.shape))} ({reason(e, 240)}).") from None
        if out.ndim != 2 or out.shape[0] != len(x):
            raise BrickyardError(f"{self.path}: gave logits of shape {'x'.join(map(str, out.shape)) or 'scalar'} for "
                                 f"{len(x)} input(s); brickyard's ONNX files give one row of logits an input.")
        return torch.from_numpy(out)
