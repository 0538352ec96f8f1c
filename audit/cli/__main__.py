from audit.cli import app

app()
