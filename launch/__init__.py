"""Thin entry points: the `podtrain` CLI, one small module per command."""
