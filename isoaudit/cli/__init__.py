"""The ``isoaudit`` command line: the root in ``app``, one module per command or command group."""

from isoaudit.cli.app import app

__all__ = ["app"]
