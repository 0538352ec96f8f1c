"""Hooks that record what a trainer or a rollout engine computed, and the sinks that ship those records.

Users reach them through the root package (``isoaudit.session``, ``isoaudit.StepBatch``); the
session lives in :mod:`isoaudit.collectors.sessions`.
"""
