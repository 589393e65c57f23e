"""Starting processes: ``torchrun.py`` (``brickyard run`` / ``train --devices``: the hand-off to
torchrun), ``nodes.py`` (several machines), ``processes.py`` (``brickyard.launch(fn, devices)`` from a
script or notebook).

This package is also callable: ``brickyard.launch(fn, devices="cpu:2", args=())`` is
``brickyard.launch.processes.launch`` (the package keeps its submodules; a function of the same name
would be replaced by the package the first time a submodule is imported)."""
from __future__ import annotations

import sys
import types


class _Launch(types.ModuleType):
    def __call__(self, fn, devices: str = "cpu:2", args: tuple = (), **options):
        from brickyard.launch.processes import launch  # lazy: `import brickyard.launch` stays torch-free
        return launch(fn, devices, args, **options)


sys.modules[__name__].__class__ = _Launch
