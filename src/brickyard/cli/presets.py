"""``brickyard presets``."""
from __future__ import annotations

from brickyard.config import list_presets


def add(sub) -> None:
    sub.add_parser("presets", help="list the shipped presets")


def run(args) -> int:
    for name, doc in list_presets().items():
        print(f"{name:<18} {doc}")
    return 0
