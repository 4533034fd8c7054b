"""Attention variants behind one interface, and the registry that names them.

>>> import variants
>>> variants.available()            # every registered name
>>> attn = variants.build("local_window", window=64)
>>> out = attn(q, k, v, causal=True)  # q, k, v: (B, H, N, D)
"""

from importlib import import_module

from .base import AttentionVariant, Unavailable, Unsupported, Workload
from .reference import full_attention_reference, oracle, reference_attention
from .registry import ENTRY_POINT_GROUP, UnknownVariant, available, build, builtin, get, register

# importing a module runs its @register; one module per built-in variant
BUILTIN_MODULES = (
    "naive",
    "sdpa",
    "chunked",
    "local_window",
    "sparse",
    "axial",
    "additive",
    "nystrom",
    "linformer",
    "flex",
    "xformers_attn",
    "linear",
    "retention",
    "performer",
    "ssd",
    "gla",
    "deltanet",
    "gated_deltanet",
    "window_linear",
)
for _m in BUILTIN_MODULES:
    import_module(f"{__name__}.{_m}")

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionVariant",
    "UnknownVariant",
    "Unavailable",
    "Unsupported",
    "Workload",
    "available",
    "builtin",
    "build",
    "full_attention_reference",
    "get",
    "oracle",
    "reference_attention",
    "register",
]
