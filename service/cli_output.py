"""What every ``so2serve`` command prints on stderr: its one-line errors and its notes."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["cli_fail", "stderr_console"]

stderr_console = Console(stderr=True)

_MESSAGE_CHARS = 600


def cli_fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: <message>`` on stderr and return the exit to raise (status ``code``)."""
    # Escaped: messages carry paths and fields like "structures[2]" that rich reads as markup.
    # One unwrapped line, so that logs and grep see the whole message: whitespace runs (an
    # HTML page quoted from another web server) become one space, and a page is cut short.
    line = " ".join(message.split())
    if len(line) > _MESSAGE_CHARS:
        line = line[: _MESSAGE_CHARS - 1] + "…"
    stderr_console.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True)
    return typer.Exit(code)
