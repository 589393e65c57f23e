"""How a config key is declared: ``_opt`` (its default, type bounds and one line of doc, read by
``config/values.py`` and the reference table) and ``Section`` (a frozen dataclass of keys that checks itself)."""
from __future__ import annotations

from dataclasses import field


def _opt(default, *, choices=None, min=None, max=None, doc="", item=None, choices_str=None, names=False):
    """A config field with validation metadata (``choices``, inclusive ``min``/``max``, list ``item``
    class, ``choices_str``: the strings a number-or-string field accepts, ``names``: a list of module or
    parameter name patterns, whose whole numbers are names too: YAML reads ``[0, fc]`` as 0 and 'fc')."""
    meta = {"choices": choices, "min": min, "max": max, "doc": doc, "item": item, "choices_str": choices_str, "names": names}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """A config section: keys declared with ``_opt``, each checked alone as the config is built
    (``config/values.py``); ``check()`` holds the rules among the section's own keys."""

    def check(self) -> None:
        """Raise ``ConfigError`` where keys this section allows one by one do not go together. Run after
        every key's own check, whenever a config is built or replaced; the default: no such rule."""
