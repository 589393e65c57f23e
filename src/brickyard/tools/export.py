"""``brickyard export RUN --format safetensors|torchscript|torch-export``: a trained model to share.

- ``safetensors``: the weights alone, with what is needed to rebuild the registry model (name,
  classes, input size, normalisation) in the file's metadata. No code runs when it is loaded.
- ``torchscript``: a self-contained inference program (``torch.jit.trace``) that takes images as
  floats in 0..1 (N x C x H x W), normalises them itself and returns logits; loads in any PyTorch,
  C++ included, without brickyard.
- ``torch-export``: the same program as a ``torch.export`` graph (``torch.export.load``), where the
  model traces cleanly.
- ``onnx``: the same program as an ONNX graph (opset ``ONNX_OPSET``, torch's dynamo-based exporter),
  input ``images`` (N x C x H x W floats in 0..1, any N) and output ``logits``, brickyard's metadata
  in the model's ``metadata_props``. Checked when written: onnxruntime runs a batch of another size
  than the one exported with and its logits must match PyTorch's within ``ONNX_RTOL`` / ``ONNX_ATOL``;
  without onnxruntime the check is skipped and the command says so. Needs the ``[onnx]`` extra
  (onnx, onnxscript; onnxruntime for the check and for ``predict``).

``brickyard predict`` and ``brickyard.predict`` accept each of these files as well as checkpoints.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from brickyard import models
from brickyard.errors import BrickyardError, reason
from brickyard.files import write_atomic
from brickyard.tools.onnx_file import META, OnnxModel
from brickyard.training import checkpoint as ckpt
from brickyard.training.checkpoint import check_model

FORMATS = {"safetensors": ".safetensors", "torchscript": ".torchscript.pt", "torch-export": ".pt2", "onnx": ".onnx"}
_META = META
ONNX_OPSET = 18
ONNX_RTOL, ONNX_ATOL = 1e-3, 1e-4  # fp32 logits of onnxruntime against PyTorch's: kernels sum in other orders


class Normalised(nn.Module):
    """``model((x - mean) / std)`` for images in 0..1: the exported programs need nothing else."""

    def __init__(self, model: nn.Module, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)


def export(source, fmt: str, out: Path | None = None, notes: list | None = None) -> Path:
    """Write ``source`` (a checkpoint or run directory) as ``fmt``; returns the file written. What the
    command should say besides (the ONNX check's result) goes in ``notes``."""
    if fmt not in FORMATS:
        raise BrickyardError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}.")
    path = ckpt.pick(Path(source))
    model, state, _ = ckpt.load_model(path)
    model.eval()
    meta = {k: state["meta"].get(k) for k in ("name", "classes", "mean", "std", "image_size", "in_channels", "num_classes")}
    # the model.* options the run built its layers with (a ViT's patch size, VGG's head): safetensors rebuilds from them
    meta.update(registry=True, format=fmt, step=state["step"], options=dict(state["meta"].get("options") or {}))
    if "temperature" in state["meta"]:  # train.calibrate's: predict divides the logits by it (a program's stay raw)
        meta["temperature"] = ckpt.temperature(state, path)
    if state["meta"].get("task") == "multilabel":  # several labels an image: predict's sigmoid and threshold
        meta.update(task="multilabel", threshold=ckpt.threshold(state, path))
    out = Path(out) if out else path.with_suffix(FORMATS[fmt])
    if not out.name.endswith(FORMATS[fmt]) or out.name == FORMATS[fmt]:
        raise BrickyardError(f"--out {out}: a {fmt} file's name ends in {FORMATS[fmt]} (that is how predict knows it).")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        _save_safetensors(model, meta, out)
        return out
    program = Normalised(model, meta["mean"], meta["std"]).eval()
    example = torch.rand(2, meta["in_channels"], *meta["image_size"])
    meta["normalises"] = True
    try:
        with torch.no_grad():
            if fmt == "torchscript":
                traced = torch.jit.trace(program, example)
                write_atomic(out, lambda f: torch.jit.save(traced, f, _extra_files={_META: json.dumps(meta)}))
            elif fmt == "onnx":
                meta["opset"] = ONNX_OPSET
                data = _onnx_bytes(program, example, meta)
                note = _check_onnx(data, program, meta)
                write_atomic(out, data)
                if notes is not None:
                    notes.append(note)
            else:
                batch = torch.export.Dim("batch", min=1, max=1 << 16)  # any batch size, not the example's
                ep = torch.export.export(program, (example,), dynamic_shapes=({0: batch},))
                write_atomic(out, lambda f: torch.export.save(ep, f, extra_files={_META: json.dumps(meta)}))
    except (OSError, BrickyardError):
        raise  # the output cannot be written, or a missing package / a failed check: the CLI says which
    except Exception as e:  # noqa: BLE001  tracing a model is where export fails, for reasons of the model's
        raise BrickyardError(f"--format {fmt}: {meta['name']} could not be exported ({reason(e)}); try --format safetensors.") from None
    return out


def _onnx_bytes(program: nn.Module, example: torch.Tensor, meta: dict) -> bytes:
    """The program as a serialised ONNX model with a dynamic batch axis and brickyard's metadata."""
    try:
        import onnx  # optional dependency, with onnxscript for torch's exporter
        import onnxscript  # noqa: F401
    except ImportError:
        raise BrickyardError("--format onnx needs the onnx and onnxscript packages: pip install 'brickyard[onnx]'.") from None
    import io
    import logging
    import warnings
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = torch.onnx.export(program, (example,), dynamo=True, opset_version=ONNX_OPSET, verbose=False,
                                         input_names=["images"], output_names=["logits"],
                                         dynamic_shapes=({0: batch},))
            buffer = io.BytesIO()
            exported.save(buffer)
    finally:
        quiet.setLevel(level)
    proto = onnx.load_from_string(buffer.getvalue())
    entry = proto.metadata_props.add()
    entry.key, entry.value = _META, json.dumps(meta)
    return proto.SerializeToString()


def _check_onnx(data: bytes, program: nn.Module, meta: dict) -> str:
    """Run the ONNX model in onnxruntime on a batch of 3 (the export used 2) and compare with PyTorch;
    a ``BrickyardError`` when they differ, the line the command prints otherwise."""
    try:  # optional dependency: the check is skipped, and said, without it
        import onnxruntime as ort
    except ImportError:
        return "not checked: onnxruntime is not installed (pip install 'brickyard[onnx]')"
    x = torch.rand(3, meta["in_channels"], *meta["image_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = program(x).numpy()
    runtime = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    got = runtime.run(["logits"], {"images": x.numpy()})[0]
    worst = float(abs(got - expected).max())
    if got.shape != expected.shape or not torch.allclose(torch.from_numpy(got), torch.from_numpy(expected),
                                                         rtol=ONNX_RTOL, atol=ONNX_ATOL):
        raise BrickyardError(f"--format onnx: onnxruntime's logits differ from PyTorch's by up to {worst:.2g} "
                             f"(allowed: rtol {ONNX_RTOL}, atol {ONNX_ATOL}); the file was not written.")
    return (f"checked: onnxruntime {ort.__version__} on a batch of 3 matches PyTorch within rtol {ONNX_RTOL}, "
            f"atol {ONNX_ATOL} (largest difference {worst:.1e}); opset {ONNX_OPSET}")


def _save_safetensors(model: nn.Module, meta: dict, out: Path) -> None:
    try:
        from safetensors.torch import save  # optional dependency
    except ImportError:
        raise BrickyardError("--format safetensors needs the safetensors package (pip install safetensors).") from None
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    write_atomic(out, save(tensors, metadata={_META: json.dumps(meta)}))


def is_exported(path) -> bool:
    p = Path(path)
    return p.is_file() and (p.suffix in (".safetensors", ".pt2", ".onnx") or p.name.endswith(".torchscript.pt"))


def carries_code(path) -> bool:
    """A TorchScript or ``torch.export`` file: loading one can run code that the file brings with it."""
    p = Path(path)
    return p.suffix == ".pt2" or p.name.endswith(".torchscript.pt")


def refuse_untrusted(path) -> None:
    kind = "torch.export (.pt2)" if Path(path).suffix == ".pt2" else "TorchScript"
    raise BrickyardError(f"{path} is a {kind} program, and loading one can run code it brings with it: load it only "
                         f"from a source you trust, with --trust-code (Python: trust_code=True); to share a model, "
                         f"export it as safetensors (`brickyard export RUN --format safetensors`), which holds weights only.")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_meta(meta, path) -> None:
    """brickyard's metadata in an exported file, as ``predict`` reads it; a field of another kind is one sentence."""
    if not isinstance(meta, dict):
        raise BrickyardError(f"{path}: its brickyard metadata is a {type(meta).__name__}, not a mapping; export it again.")
    size = meta.get("image_size")
    bad = ("name" if not isinstance(meta.get("name"), str) else
           "num_classes" if not _count(meta.get("num_classes")) else
           "in_channels" if not _count(meta.get("in_channels")) else
           "image_size" if not (isinstance(size, list) and len(size) == 2 and all(map(_count, size))) else
           "classes" if not isinstance(meta.get("classes") or [], list) else None)
    if bad is None and not meta.get("normalises"):
        for key in ("mean", "std"):
            v = meta.get(key)
            if not (isinstance(v, list) and len(v) in (1, meta["in_channels"])
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
                bad = key
                break
    if bad is not None:
        raise BrickyardError(f"{path}: its brickyard metadata holds {bad} = {repr(meta.get(bad))[:80]}, "
                             "not what an export writes; export it again.")


def load_exported(path, trust_code: bool = False) -> tuple[nn.Module, dict]:
    """The model (or program) in an exported file and its metadata; a file of another kind is one sentence.
    A safetensors file holds weights only and is always read; a TorchScript or ``.pt2`` program (which
    ``torch.jit.load`` and ``torch.export.load`` may run code from) only with ``trust_code``."""
    path = Path(path)
    if carries_code(path) and not trust_code:
        refuse_untrusted(path)
    extra = {_META: ""}
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open  # optional dependency
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(_META, "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if not meta.get("name"):
                raise BrickyardError(f"{path} holds weights without brickyard's metadata; load them with finetune.init_from.")
            check_meta(meta, path)
            model = models.create(meta["name"], meta["num_classes"], meta["in_channels"], tuple(meta["image_size"]),
                                  **dict(meta.get("options") or {}))
            check_model({"model": tensors, "meta": {"model": meta["name"]}}, model, path, what="")  # a mismatch names its key
            model.load_state_dict(tensors)
            return model.eval(), meta
        if path.suffix == ".onnx":  # a graph of standard operators: data, not code brickyard would run
            model = OnnxModel(path)
            if not model.meta.get("name"):
                raise BrickyardError(f"{path} is an ONNX model without brickyard's metadata; run it with onnxruntime directly.")
            check_meta(model.meta, path)
            model.check()
            return model, model.meta
        if path.suffix == ".pt2":
            program = torch.export.load(str(path), extra_files=extra).module()
        else:
            program = torch.jit.load(str(path), map_location="cpu", _extra_files=extra).eval()
        meta = json.loads(extra[_META] or "{}")
        if meta:  # a program without brickyard's metadata runs on tensors as they are
            check_meta(meta, path)
        return program, meta
    except BrickyardError:
        raise
    except Exception as e:  # noqa: BLE001  a damaged or foreign file
        raise BrickyardError(f"{path} cannot be read as an exported brickyard model ({reason(e, 160)}).") from None
