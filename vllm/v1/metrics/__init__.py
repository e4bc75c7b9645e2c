"""Serving metrics: per-request timing stats and their Prometheus collectors."""
