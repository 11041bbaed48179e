"""The worker side of `podtrain train`: pre-flight checks, building a run, the pure jitted step, the loop, metrics."""
