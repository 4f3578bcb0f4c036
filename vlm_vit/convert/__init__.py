"""Checkpoint converters, one module per source family."""
