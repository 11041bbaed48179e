"""The training job in wings with one job each: config, train, data, checkpoint, plan, inference, cluster."""
