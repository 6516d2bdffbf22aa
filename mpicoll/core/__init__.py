"""Basics every layer uses: dtype/op tables, errors, options."""
