"""Every command's ``--help`` wraps as rich formats it, at a narrow and at a wide terminal: no line of
help text ends early because its source had a line break (a docstring's), wherever it shows (the
command's own description, its options, the command list of its group)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from isoaudit.cli import app

runner = CliRunner()
BORDER = "│"


def command_paths() -> Iterator[list[str]]:
    """Every command and group of the CLI, as the arguments that reach it."""

    def walk(command: object, path: list[str]) -> Iterator[list[str]]:
        yield path
        if hasattr(command, "list_commands"):
            context = type(command).context_class(command)  # type: ignore[attr-defined]
            for name in command.list_commands(context):
                yield from walk(command.get_command(context, name), [*path, name])  # type: ignore[attr-defined]

    yield from walk(typer.main.get_command(app), [])


def hard_breaks(output: str, width: int) -> list[str]:
    """Lines that end although the next line's first word would have fitted after them: a break
    the source made, not the wrapping (rich wraps greedily). In a panel, the next line must carry on
    the column the line above ends in (the same start, one column's text between); outside one, the
    same paragraph. Typer's ``[default: ...]``, ``[env var: ...]`` and ``[required]`` are blocks of
    their own (rich's ``Columns``) and may start a line."""
    found = []
    lines = [line.rstrip() for line in output.splitlines()]
    for above, below in zip(lines, lines[1:], strict=False):
        words = below.replace(BORDER, " ").split()
        if not above.strip() or not words or words[0].startswith("["):
            continue
        if above.startswith(BORDER) and below.startswith(BORDER):
            right = above.rfind(BORDER)
            if right <= 0 or below.rfind(BORDER) != right:
                continue
            start = len(below) - len(below[1:].lstrip()) if below[1:].strip() else 0
            text_end = len(above[:right].rstrip())
            column = above[start:text_end]
            if (
                start <= 1
                or above[start - 1] != " "
                or not column.strip()
                or column[0] == " "
                or "  " in column
            ):
                continue  # a new row, or a line of another column
            room = (right - 1) - text_end - 1  # a cell keeps one column of padding
        elif above.startswith(" ") and below.startswith(" ") and not below.startswith("  "):
            room = (width - 1) - len(above) - 1
        else:
            continue
        if len(words[0]) <= room:
            found.append(f"{above}\n{below}")
    return found


@pytest.mark.parametrize("width", [60, 200])
def test_help_text_wraps_as_rich_formats_it(width: int) -> None:
    paths = list(command_paths())
    assert len(paths) > 15  # the root, every group and command
    broken = {}
    for path in paths:
        shown = runner.invoke(app, [*path, "--help"], terminal_width=width, env={"COLUMNS": str(width)})
        assert shown.exit_code == 0, (path, shown.output)
        assert max(len(line) for line in shown.output.splitlines()) <= width, path
        breaks = hard_breaks(shown.output, width)
        if breaks:
            broken[" ".join(path) or "isoaudit"] = breaks
    assert not broken, "\n\n".join(f"{name}:\n" + "\n--\n".join(b) for name, b in broken.items())


def test_the_check_sees_a_hard_break() -> None:
    """The check itself: a docstring's line break inside a sentence is found, in a panel and out."""
    demo = typer.Typer()

    @demo.command()
    def first() -> None:
        """One sentence that its docstring breaks
        here, in the middle."""

    @demo.command()
    def second() -> None:
        """Another."""

    shown = runner.invoke(demo, ["--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert hard_breaks(shown.output, 200)
    shown = runner.invoke(demo, ["first", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert shown.exit_code == 0
