"""How Spool logs: the levels and format `serve` asks for."""

import logging
import sys


def configure_logging(args) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
