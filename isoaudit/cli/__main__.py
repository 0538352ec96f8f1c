from isoaudit.cli import app

app()
