"""The typed config schema, presets with `key=value` overrides, and the one validation pass."""
