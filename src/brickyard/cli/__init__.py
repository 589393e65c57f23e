"""The ``brickyard`` command line: ``brickyard.cli.main`` and one module per command."""
from brickyard.cli.main import main, run  # noqa: F401
