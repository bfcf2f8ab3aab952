import sys

try:  # Ctrl-C while the command's modules load: the CLI's one line and exit code too
    # (errors.NOTHING_WRITTEN and EXIT_INTERRUPTED, spelled here: memplan may not be loaded)
    from memplan.cli import run
except KeyboardInterrupt:
    print("memplan: interrupted: nothing was written", file=sys.stderr)
    sys.exit(130)

run()
