"""`python -m app`: the `spool` command (app/cli.py) for a checkout that is not installed."""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m app"))
