"""Where nvtp keeps what it computed once for later runs: ``$NVTP_CACHE_DIR`` (default
``~/.cache/nvtp``), or nowhere with ``NVTP_CACHE=0``. Its parts: ``traces/`` (``nvtp/tracecache.py``)
and ``inductor/`` (Inductor's own cache under ``compile="inductor"``: ``nvtp/execute/inductor_cache.py``)."""

from __future__ import annotations

import os
from pathlib import Path


def root() -> Path | None:
    """nvtp's cache directory, or None when caching is off (``NVTP_CACHE=0``)."""
    if os.environ.get("NVTP_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    return Path(os.environ.get("NVTP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nvtp"))
