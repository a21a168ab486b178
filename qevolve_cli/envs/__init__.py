"""Environments (SPEC §2): one interface, real adapters, task splits, a worker pool."""
