"""Observability and checks: per-call observation, traces, traffic counts, call fingerprints."""
