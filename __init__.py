"""podtrain: distributed training of Llama 3, Qwen3 and DeepSeek-V3 class models with JAX, Flax NNX and Ray.

The repository's top-level folders install as its subpackages: `podtrain.models`,
`podtrain.sharding`, `podtrain.orchestrator` and `podtrain.launch`, with the YAML presets of
`configs/` as package data.
"""
