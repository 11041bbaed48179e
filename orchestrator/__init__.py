"""The training job: config schema, the Ray control plane, the train loop, steps, data, checkpoints."""
