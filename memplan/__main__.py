import sys

try:  # Ctrl-C while the command's modules load: the CLI's one line and exit code too
    from memplan.cli import run
except KeyboardInterrupt:
    print("memplan: interrupted: nothing was written", file=sys.stderr)
    sys.exit(130)

run()
