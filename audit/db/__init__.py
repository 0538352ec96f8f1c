"""The data layer: the one door into the database."""
