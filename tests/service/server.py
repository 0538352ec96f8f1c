"""Tests run the real service through :mod:`audit.api.live`; re-exported here for the test suites."""

from audit.api.live import LiveServer, free_port, serve_in_thread

__all__ = ["LiveServer", "free_port", "serve_in_thread"]
