"""The MQAR benchmark's reference layers: an independent implementation of each hybridzoo mixer,
held where a hybridzoo ``Block`` holds its mixer (:mod:`benchmarks.mqar`)."""

from __future__ import annotations

KINDS = ("mamba1", "mamba2", "gla", "retnet", "gdn", "attn")
REFERENCE_NAMES = {"gdn": "fla GatedDeltaNet", "gla": "fla GatedLinearAttention",
                   "retnet": "fla MultiScaleRetention", "mamba1": "mamba_ssm Mamba",
                   "mamba2": "mamba_ssm Mamba2", "attn": "transformers LlamaAttention (sdpa)"}
NEEDS_CUDA = {"gdn", "gla", "retnet", "mamba1", "mamba2"}  # reference layers without a CPU path


# fla's GatedDeltaNet keeps q, k, v (and their convolutions) apart, hybridzoo's concatenated:
# hybridzoo's name -> the reference layer's names, in concatenation order
_GDN_PARTS = {"in_proj_qkv.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
              "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
              "in_proj_z.weight": ("g_proj.weight",), "in_proj_a.weight": ("a_proj.weight",),
              "in_proj_b.weight": ("b_proj.weight",), "norm.weight": ("o_norm.weight",),
              "out_proj.weight": ("o_proj.weight",)}


def hybridzoo_tensors(kind: str, tensors: dict, like: dict) -> dict:
    """A reference model's weights or gradients (``{name: tensor}`` under the reference model's
    names, as ``build_model(..., "reference", ...)`` builds it) under hybridzoo's names and shapes.

    ``like`` is a hybridzoo model's state dict of the same recipe (for the shapes). Mixer tensors
    move from ``blocks.i.mixer.layer.*`` to ``blocks.i.mixer.*``; fla's separate q/k/v projections
    and convolutions are concatenated as hybridzoo's fused ones (a gradient concatenates the same
    way, the map being linear); short-convolution weights ``[C, 1, W]`` become ``[C, W]``; the
    Llama reference's rotary table (a buffer) is dropped. Raises if a name is left unmatched.
    """
    import torch

    out, grouped = {}, {}
    for name, tensor in tensors.items():
        if ".mixer.rotary." in name:
            continue
        if ".mixer.layer." not in name:
            out[name] = tensor
            continue
        prefix, local = name.split(".mixer.layer.", 1)
        target = next((t for t, parts in _GDN_PARTS.items() if local in parts), None) if kind == "gdn" else None
        if target is None:
            out[f"{prefix}.mixer.{local}"] = tensor
        else:
            grouped.setdefault(f"{prefix}.mixer.{target}", {})[_GDN_PARTS[target].index(local)] = tensor
    for name, pieces in grouped.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)])
    for name, tensor in out.items():
        if name in like and tensor.dim() == like[name].dim() + 1 and tensor.shape[1] == 1:
            out[name] = tensor.squeeze(1)
    unknown = sorted(set(out) - set(like))
    if unknown:
        raise KeyError(f"hybridzoo_tensors: {kind} reference names with no hybridzoo counterpart: {unknown}")
    return out


# ---- the reference layers ----------------------------------------------------------------------
def reference_skip_reason(kind: str, device: str) -> str | None:
    """Why the reference layer of ``kind`` cannot run here (None: it can)."""
    import importlib.util

    if kind in NEEDS_CUDA and not device.startswith("cuda"):
        return f"{REFERENCE_NAMES[kind]} needs CUDA (no CPU path); skipped on {device}"
    package = {"gdn": "fla", "gla": "fla", "retnet": "fla", "mamba1": "mamba_ssm", "mamba2": "mamba_ssm",
               "attn": "transformers"}[kind]
    if importlib.util.find_spec(package) is None:
        return f"{REFERENCE_NAMES[kind]} needs the {package} package (pip install {package})"
    return None


def _normal_init(layer, std: float, types: tuple) -> None:
    """A model class's init of its layer, as fla's and transformers' ``_init_weights`` apply it:
    weights of the modules of ``types`` ~ N(0, std²), their biases 0, in ``modules()`` order."""
    from torch import nn

    for module in layer.modules():
        if isinstance(module, types):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class ReferenceMixer:
    """Factory of an ``nn.Module`` that holds a reference layer in a hybridzoo ``Block``:
    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], None)`` (no state: training only)."""

    @staticmethod
    def build(kind: str, config):
        import torch
        from torch import nn

        d = config.d_model
        c = getattr(config, kind)
        if kind in ("gdn", "gla", "retnet"):
            from benchmarks.fla_backward import allow_fla_gated_backward

            allow_fla_gated_backward()
        if kind == "gdn":
            from fla.layers import GatedDeltaNet

            layer = GatedDeltaNet(hidden_size=d, head_dim=c.head_k_dim, num_heads=c.num_k_heads,
                                  num_v_heads=c.num_v_heads, expand_v=c.head_v_dim / c.head_k_dim,
                                  conv_size=c.conv_size, norm_eps=c.norm_eps)
            call = lambda m, x: m(x)[0]  # noqa: E731
        elif kind in ("gla", "retnet"):
            from fla.layers import GatedLinearAttention, MultiScaleRetention

            common = dict(mode="chunk", hidden_size=d, expand_k=c.expand_k, expand_v=c.expand_v,
                          num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, use_short_conv=c.use_short_conv,
                          conv_size=c.conv_size, conv_bias=c.conv_bias, use_output_gate=c.use_output_gate,
                          norm_eps=c.norm_eps)
            if kind == "gla":
                layer = GatedLinearAttention(gate_logit_normalizer=c.gate_logit_normalizer,
                                             gate_low_rank_dim=c.gate_low_rank_dim, clamp_min=c.clamp_min, **common)
            else:
                layer = MultiScaleRetention(**common)
            _normal_init(layer, c.initializer_range, (nn.Linear, nn.Conv1d))  # FLAPreTrainedModel._init_weights
            call = lambda m, x: m(x)[0]  # noqa: E731
        elif kind == "mamba1":
            from mamba_ssm import Mamba

            layer = Mamba(d_model=d, d_state=c.d_state, d_conv=c.d_conv, expand=c.expand, dt_rank=c.dt_rank,
                          dt_min=c.dt_min, dt_max=c.dt_max, dt_init=c.dt_init, dt_scale=c.dt_scale,
                          dt_init_floor=c.dt_init_floor, conv_bias=c.conv_bias, bias=c.bias)
            call = lambda m, x: m(x)  # noqa: E731
        elif kind == "mamba2":
            from mamba_ssm import Mamba2

            layer = Mamba2(d_model=d, d_state=c.d_state, d_conv=c.d_conv, expand=c.expand, headdim=c.head_dim,
                           ngroups=c.n_groups, chunk_size=c.chunk_size, A_init_range=tuple(c.A_init_range),
                           dt_min=c.dt_min, dt_max=c.dt_max, dt_init_floor=c.dt_init_floor,
                           conv_bias=c.conv_bias, bias=c.bias)
            call = lambda m, x: m(x)  # noqa: E731
        elif kind == "attn":
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

            if c.qk_norm or c.output_gate:
                raise ValueError("benchmarks.mqar: the Llama reference has no q/k norms and no output gate")
            heads = c.n_heads
            llama = LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=c.n_kv_heads or heads,
                                head_dim=c.head_dim or d // heads, rope_theta=c.rope_base, attention_bias=c.bias,
                                max_position_embeddings=1 << 16, initializer_range=c.initializer_range)
            llama._attn_implementation = "sdpa"
            layer = LlamaAttention(llama, layer_idx=0)
            _normal_init(layer, c.initializer_range, (nn.Linear,))  # LlamaPreTrainedModel._init_weights
            rotary = LlamaRotaryEmbedding(llama)

            def call(m, x):
                positions = torch.arange(x.shape[1], device=x.device)
                mask = None  # full causal attention: SDPA's is_causal
                if c.window is not None:  # key j visible from query i iff 0 <= i - j < window
                    gap = positions[:, None] - positions[None, :]
                    mask = torch.zeros(gap.shape, dtype=x.dtype, device=x.device).masked_fill(
                        (gap < 0) | (gap >= c.window), float("-inf"))[None, None]
                return m(x, position_embeddings=rotary(x, positions[None]), attention_mask=mask)[0]
        else:
            raise ValueError(f"benchmarks.mqar: unknown mixer kind {kind!r}")

        extra = rotary if kind == "attn" else None  # its table moves with the model (no host copy per call)

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = layer
                if extra is not None:
                    self.rotary = extra

            def forward(self, x, state=None):
                return call(self.layer, x), None

        return Wrapped()
