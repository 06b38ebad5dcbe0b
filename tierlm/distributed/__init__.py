"""Processes and their communication for multi-process inference (pipeline parallelism)."""
