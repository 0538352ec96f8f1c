"""Hooks that record what a trainer or a vLLM engine computed, and the sinks that ship those records."""
