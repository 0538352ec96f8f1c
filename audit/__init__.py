"""isoaudit's audit core: records, the data layer, comparator, metrics, diagnosis, contract, alerts and the API."""

__version__ = "0.1.0"
