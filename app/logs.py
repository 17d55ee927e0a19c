"""How Spool logs: the levels and format `serve` asks for, on the standard logging module.

--log-level sets the root level; the HTTP layer's loggers (request lines, connections, the
listener, Hypercorn) take --uvicorn-log-level instead when it is given, as uvicorn's do under
vLLM, and --disable-log-requests lifts the request lines' logger to WARNING. With
--log-format json every line on stderr is one JSON object (log shippers read one per line):
time, level, logger, message, a request line's fields as keys of their own, and a traceback
as one string; Python's warnings and uncaught exceptions go through logging, so they are JSON too.
"""

import json
import logging
import sys
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HTTP_LOGGERS = ("spool.http", "spool.connection", "spool.listener", "hypercorn")
QUIET_LOGGERS = ("numba",)  # at DEBUG, numba logs its compiler's passes: tens of thousands of lines a start
REQUEST_LOGGER = "spool.http"  # app/server/access_log.py's line per request


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (json.dumps escapes the newlines)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def log_uncaught(kind, value, traceback) -> None:
    logging.getLogger("spool").critical("uncaught exception", exc_info=(kind, value, traceback))


def configure_logging(args) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if args.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    http_level = (args.uvicorn_log_level or args.log_level).upper()
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(http_level)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.disable_log_requests:
        logging.getLogger(REQUEST_LOGGER).setLevel(max(logging.WARNING, logging.getLevelName(http_level)))
    logging.captureWarnings(True)
    if args.log_format == "json":
        sys.excepthook = log_uncaught
