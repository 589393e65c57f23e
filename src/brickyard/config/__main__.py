"""``python -m brickyard.config [docs/configuration.md]``: print the configuration table, or rewrite it in the file."""
import sys
from pathlib import Path

from brickyard.config import markdown_table, update_reference

if len(sys.argv) > 1:
    print("updated" if update_reference(Path(sys.argv[1])) else "unchanged")
else:
    print(markdown_table())
