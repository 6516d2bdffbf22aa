"""Command-line tools: verify, bench, info."""
