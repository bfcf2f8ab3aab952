from memplan.cli import run

run()
