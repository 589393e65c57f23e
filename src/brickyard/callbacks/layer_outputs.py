"""``LayerOutputs``: chosen layers' raw outputs during training, on every N-th step, at no cost to
the steps in between.

The Paddle FAQ's question ("how do I read a layer's output while training?"), answered without a
second forward pass and without touching the model's mode: on a capture step the callback puts
forward hooks on the modules whose names match (``fnmatch``, names as `brickyard inspect` shows them),
keeps a detached copy of each output of that step's forward pass (the last micro-batch's, with
``train.grad_accum``), and takes the hooks off again before the update. Other steps run without hooks.

    from brickyard.callbacks import LayerOutputs
    grab = LayerOutputs(["conv1", "fc"], every=100)
    brickyard.fit(model, train, config=..., callbacks=[grab])
    grab.outputs[200]["conv1"]           # the tensor conv1 returned at step 200 (on the CPU)

Subclass it and override ``on_capture(run, step, outputs)`` to write them somewhere instead of keeping
them (``keep`` bounds how many steps stay in memory).
"""
from __future__ import annotations

import fnmatch

import torch

from brickyard.callbacks.base import Callback, argument
from brickyard.errors import ConfigError


class LayerOutputs(Callback):
    def __init__(self, patterns, every: int = 100, keep: int = 10, to_cpu: bool = True):
        if isinstance(patterns, str):
            patterns = [patterns]
        every = argument("LayerOutputs", "every", every, whole=True, least=1)
        keep = argument("LayerOutputs", "keep", keep, whole=True, least=1)
        self.patterns, self.every, self.keep, self.to_cpu = list(patterns), int(every), int(keep), to_cpu
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._hooks: list = []
        self._found: dict[str, torch.Tensor] = {}

    def _modules(self, model):
        chosen = [(n, m) for n, m in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in self.patterns)]
        if not chosen:
            names = [n for n, _ in model.named_modules() if n]
            raise ConfigError(f"LayerOutputs: {', '.join(self.patterns)} match no module; names look like "
                              f"{', '.join(names[:5])}, ...")
        return chosen

    def on_train_start(self, run):
        self._modules(run.model)  # a pattern that matches nothing is said before the first step

    def on_step_start(self, run):
        if run.step % self.every:
            return
        self._found = {}
        for name, module in self._modules(run.model):
            self._hooks.append(module.register_forward_hook(self._grab(name)))

    def _grab(self, name: str):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor):
                kept = output.detach()
                self._found[name] = kept.to("cpu", copy=True) if self.to_cpu else kept.clone()
        return hook

    def on_before_update(self, run):
        if not self._hooks:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.on_capture(run, run.step, self._found)

    def on_capture(self, run, step: int, outputs: dict[str, torch.Tensor]) -> None:
        """What to do with a capture step's outputs; by default keep the newest ``keep`` steps in ``outputs``."""
        self.outputs[step] = outputs
        for old in sorted(self.outputs)[:-self.keep]:
            del self.outputs[old]
