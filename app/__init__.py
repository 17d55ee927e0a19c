"""Requests: the `spool` command, the engine and the HTTP server."""

from importlib import metadata

DISTRIBUTION = "spool-llm"  # `spool` on the package index is an unrelated project


def version() -> str:
    """The installed distribution's version; a checkout run without installing has none."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"
