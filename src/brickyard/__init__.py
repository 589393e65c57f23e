"""brickyard: train image classifiers on one CPU, one GPU, the GPUs you pick, or many machines."""
__version__ = "0.3.0"

__all__ = ["fit", "launch", "predict", "load_config", "Config", "Callback", "Run", "__version__"]


def __getattr__(name):  # keep `import brickyard` (and the CLI's start-up) light
    if name == "fit":
        from brickyard.api import fit
        return fit
    if name == "predict":
        from brickyard.tools.predict import predict
        return predict
    if name == "launch":  # the package brickyard.launch, callable: launch(fn, devices="cpu:2", args=())
        import importlib
        return importlib.import_module("brickyard.launch")
    if name == "Callback":
        from brickyard.callbacks import Callback
        return Callback
    if name == "Run":
        from brickyard.training.run import Run
        return Run
    if name in ("load_config", "Config"):
        from brickyard import config
        return getattr(config, name)
    raise AttributeError(f"module 'brickyard' has no attribute {name!r}")
