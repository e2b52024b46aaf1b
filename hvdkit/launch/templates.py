"""Render the job-script templates: package data in ``hvdkit/templates/`` (``slurm/`` at the
top of the repository is a link to it, where users look for them).

Jinja2 rather than ``string.Template``: the templates need conditionals and
loops (optional ``#SBATCH`` lines, modules, exports), and with
``string.Template`` every bash ``$VAR`` in them would have to be written
``$$VAR``, which makes them hard for users to copy and adapt. Safety comes
from ``finalize``: every ``{{ value }}`` is passed through ``shlex.quote``
unless the Python side marked it :class:`Raw` after validating it, so a
template cannot forget to quote a path with spaces, quotes or ``$``.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import shlex
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["Raw", "template_dir", "render_template", "check_env_name"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env_name(key: str) -> str:
    """``key`` if it can be ``export``ed by a generated script, else a one-line ConfigError."""
    if not _ENV_NAME.match(key):
        raise ConfigError(f"environment name {key!r} is invalid", "use NAME=value with NAME like FOO_BAR")
    return key


class Raw(str):
    """A string already validated as safe shell text; emitted without quoting."""


def _finalize(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value is None:
        raise ConfigError("a template printed a missing value", "fix the template in slurm/")
    text = shlex.quote(str(value))
    # '=eth1' needs no quotes for bash, but X==eth1 reads as a typo (shellcheck SC1097)
    return f"'{text}'" if text.startswith("=") else text


def template_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where templates live: ``explicit`` (``--template-dir``), ``$HVDKIT_TEMPLATE_DIR``, or the
    package's own ``hvdkit/templates`` (read with :mod:`importlib.resources`, so wheel,
    ``--user`` and editable installs all find them)."""
    for cand, origin in ((explicit, "--template-dir"), (os.environ.get("HVDKIT_TEMPLATE_DIR"),
                                                         "HVDKIT_TEMPLATE_DIR")):
        if cand:
            if not (Path(cand) / "_header.sbatch").is_file():
                raise ConfigError(f"template directory {cand} ({origin}) has no _header.sbatch",
                                  "copy the folder 'hvdkit slurm --print-template-dir' prints and edit "
                                  "the copy")
            return Path(cand)
    packaged = Path(str(importlib.resources.files("hvdkit") / "templates"))
    if not (packaged / "_header.sbatch").is_file():
        raise ConfigError(f"hvdkit's templates are missing from {packaged}",
                          "reinstall hvdkit (its wheel carries them as package data)")
    return packaged


def render_template(name: str, context: dict[str, Any], directory: Path | None = None) -> str:
    """Render ``slurm/<name>`` with ``context``; pure apart from reading the template files."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory or template_dir())),
        undefined=jinja2.StrictUndefined,
        finalize=_finalize,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        # bash's ${#array[@]} would otherwise open a Jinja comment
        comment_start_string="{##",
        comment_end_string="##}",
    )
    try:
        return env.get_template(name).render(**context)
    except jinja2.TemplateNotFound:
        raise ConfigError(f"template {name} not found in {directory or template_dir()}",
                          "copy hvdkit's slurm/ folder and edit the copy") from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template {name} uses an unknown value: {exc}",
                          "check the variable names against 'hvdkit slurm --print-config'") from None
