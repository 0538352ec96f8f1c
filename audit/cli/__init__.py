"""The ``isoaudit`` command line: ``app`` here, one module per command group beside it."""

from audit.cli.app import app, console

__all__ = ["app", "console"]
