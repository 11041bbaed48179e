"""Kernels: the attention backends and the grouped matmul and ragged exchange of the MoE experts.

The floor below the model code: it imports jax only, and every choice of implementation is an
argument resolved once when a run is built (`model.attention`, `model.moe.grouped_matmul`,
`model.moe.exchange`, `model.interpret_kernels`), never a question asked of the platform here.
"""
