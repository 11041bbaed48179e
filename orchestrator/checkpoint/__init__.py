"""Orbax checkpoints, their fingerprints, where a run resumes, and the run directory."""
