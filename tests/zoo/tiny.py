"""Tiny settings for every mixer kind, so test models build in milliseconds."""

from hybridzoo import HybridConfig

KINDS = ["mamba1", "mamba2", "gla", "retnet", "gdn", "attn"]

TINY_BLOCKS = dict(
    mamba1=dict(d_state=4),
    mamba2=dict(d_state=8, head_dim=8, chunk_size=8),
    gla=dict(num_heads=2, chunk_size=8),
    retnet=dict(num_heads=2, chunk_size=8),
    gdn=dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, chunk_size=8),
    attn=dict(n_heads=4, n_kv_heads=2, window=5),
)


def tiny_config(layers, **overrides) -> HybridConfig:
    layers = layers if isinstance(layers, list) else layers.split()
    fields = dict(vocab_size=37, d_model=32, n_layers=len(layers), layers=layers, d_mlp=48, **TINY_BLOCKS)
    fields.update(overrides)
    return HybridConfig(**fields)
