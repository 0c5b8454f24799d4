import sys

try:
    from powertrain.cli import main  # imports torch: seconds, during which Ctrl-C must not print a traceback

    sys.exit(main())
except KeyboardInterrupt:
    print("powertrain: interrupted", file=sys.stderr)
    sys.exit(130)
