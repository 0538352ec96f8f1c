"""The ``isoaudit`` command line: ``app`` here, one module per command group beside it."""

from isoaudit.cli.app import app, console

__all__ = ["app", "console"]
