"""``python -m isoaudit``: the command line, as the ``isoaudit`` console script runs it."""

from isoaudit.cli import app

app()
