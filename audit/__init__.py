"""isoaudit's audit core: records, store, comparator, metrics, diagnosis, contract, alerts, API, CLI."""

__version__ = "0.1.0"
