from brickyard.cli.main import run

run()
