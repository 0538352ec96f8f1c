"""Alembic environment and revisions of isoaudit's schema (``isoaudit db upgrade`` applies them)."""

from pathlib import Path

#: Handed to Alembic as ``script_location``; works from a checkout and from an installed wheel.
SCRIPT_LOCATION = str(Path(__file__).resolve().parent)
