"""``brickyard models``."""
from __future__ import annotations


def add(sub) -> None:
    sub.add_parser("models", help="list the model registry with parameter counts")


def run(args) -> int:
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard import models
    for name in models.names():
        channels, size = models.natural_input(name)
        n = models.count_parameters(models.create(name, 10, channels, size))
        print(f"{name:<18} {n:>12,} params  ({channels}x{size[0]}x{size[1]}, 10 classes)  {models.describe(name)}")
    return 0
