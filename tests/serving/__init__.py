"""Serving tests: a graft server under load, faults and bad input (package-scoped servers)."""
