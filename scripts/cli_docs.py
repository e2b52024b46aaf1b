"""Write docs/cli.md from the commands' own --help (tests/test_light_cli.py checks it is current).

usage: python scripts/cli_docs.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hvdkit.cli import cli

OUT = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _walk(command: click.Command, path: list[str]) -> list[tuple[str, str]]:
    with click.Context(command, info_name=" ".join(path), terminal_width=100, max_content_width=100) as ctx:
        pages = [(" ".join(path), command.get_help(ctx))]
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                pages += _walk(sub, [*path, name])
    return pages


def render() -> str:
    """The whole page: one section per command, its help as click prints it."""
    parts = ["# Command reference", "",
             "Generated from each command's `--help` by `scripts/cli_docs.py`; every default and choice",
             "comes from the config dataclasses (`hvdkit/config.py`, `hvdkit/launch/slurm.py`).", ""]
    for name, text in _walk(cli, ["hvdkit"]):
        parts += [f"## `{name}`", "", "```", text.rstrip(), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    text = render()
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == text else "docs/cli.md is stale: run python scripts/cli_docs.py")
    OUT.write_text(text)
