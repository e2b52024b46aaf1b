"""Small file writes that a crash or a concurrent reader never sees half-done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_text_atomic", "write_json_atomic"]


def write_text_atomic(path: str | os.PathLike[str], text: str, executable: bool = False) -> Path:
    """Write ``text`` to ``.<name>.tmp<pid>`` beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    if executable:
        tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Pretty JSON (non-JSON values as ``str``), written atomically."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")
