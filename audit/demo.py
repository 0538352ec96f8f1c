"""``make demo``: set up the default SQLite store and show what it holds.

Grows into the full demo (a tiny model trained and rolled out with both collectors attached) as the
collectors land; until then it prepares the database for real and lists its runs.
"""

from __future__ import annotations

from rich.console import Console

from audit.config import database_url
from audit.migrate import current_revision, upgrade
from audit.store import Store


def main() -> None:
    console = Console()
    url = database_url()
    upgrade(url)
    console.print(f"[bold]isoaudit[/bold] store ready at {url} (revision {current_revision(url)})")
    runs = Store(url, upgrade=False).list_runs()
    console.print(
        f"{len(runs)} run(s) recorded" + "".join(f"\n  {r.run_id}: {r.n_steps} step(s)" for r in runs)
    )


if __name__ == "__main__":
    main()
