import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C during the first imports
    print("ampkit: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
