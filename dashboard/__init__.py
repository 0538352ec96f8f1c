"""Dash dashboard: mismatch heatmaps, timelines and the remediation toggle."""
