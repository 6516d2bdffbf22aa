"""The collective algorithms, each a schedule of steps."""
