"""Mixture of experts: the router, the expert-parallel dispatch (capacity and dropless), the SwiGLU
experts and DeepSeek-V3's MoE block."""

from podtrain.models.moe.block import MoE
from podtrain.models.moe.router import balance_router_bias, route

__all__ = ["MoE", "balance_router_bias", "route"]
