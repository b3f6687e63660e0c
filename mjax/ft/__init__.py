"""Fault tolerance: heartbeats, fault detection, diagnostics, stragglers,
the supervising driver, and test-only fault injection."""
