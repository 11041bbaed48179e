"""A model placed on its mesh: what the training loop, generation, export, the service and the
plan share. The mesh of a config (`mesh.py`), its kernels resolved once for the devices
(`kernels.py`), the model with its adapters laid out sharded without being made (`model.py`), and
restored from a checkpoint, an HF directory or a PEFT adapter (`restore.py`)."""
