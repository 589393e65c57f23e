from brickyard.cli import run

run()
