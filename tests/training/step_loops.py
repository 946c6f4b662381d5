"""Independent step-loop implementations of the six mixers and of the model around them.

Written from the papers' equations (and the layer docstrings, which state them), with plain
PyTorch loops over time: no hybridzoo kernel, layer or model code is called. Each mixer is a
function ``mix(p, x) -> y`` of a dict ``p`` of parameters named as in hybridzoo's state dict
(the prefix ``blocks.{i}.mixer.`` removed) and ``x [B, T, d_model]``. :class:`LoopLM` holds its
own copies of the parameters, under hybridzoo's names, so that ``load_state_dict`` copies the
same weights into both implementations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# ---- shared pieces ----------------------------------------------------------------------------
def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv ``y_t = sum_j w[:, j] x_{t - W + 1 + j}`` (+ bias), then SiLU."""
    B, T, C = x.shape
    W = weight.shape[1]
    padded = torch.cat([x.new_zeros(B, W - 1, C), x], dim=1)
    y = sum(weight[:, j] * padded[:, j:j + T] for j in range(W))
    if bias is not None:
        y = y + bias
    return F.silu(y)


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half convention), positions 0..T-1. ``x [B, T, H, D]``."""
    T, D = x.shape[1], x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]          # [T, D/2]
    cos, sin = ang.cos().to(x.dtype)[None, :, None], ang.sin().to(x.dtype)[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def gated_out(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head ``rmsnorm(o) * weight * silu(z)`` (GDN, GLA, RetNet output gate). ``o, z [B, T, H, V]``."""
    return rms(o, eps) * weight * F.silu(z)


# ---- the mixers --------------------------------------------------------------------------------
def gdn(p: dict, x: torch.Tensor, c) -> torch.Tensor:
    """Gated DeltaNet: S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = K^-1/2 S_t^T q_t."""
    B, T, _ = x.shape
    Hk, H, K, V = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
    qkv = causal_conv_silu(x @ p["in_proj_qkv.weight"].T, p["conv1d.weight"], None)
    q, k, v = qkv.split([Hk * K, Hk * K, H * V], dim=-1)
    l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = l2(q.reshape(B, T, Hk, K)).repeat_interleave(H // Hk, dim=2)
    k = l2(k.reshape(B, T, Hk, K)).repeat_interleave(H // Hk, dim=2)
    v = v.reshape(B, T, H, V)
    beta = torch.sigmoid(x @ p["in_proj_b.weight"].T)                         # [B, T, H]
    a = torch.exp(-torch.exp(p["A_log"]) * F.softplus(x @ p["in_proj_a.weight"].T + p["dt_bias"]))
    S = x.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        S = a[:, t, :, None, None] * (S - bt * kt[..., None] * (kt[..., None] * S).sum(-2, keepdim=True))
        S = S + bt * kt[..., None] * vt[..., None, :]
        outs.append(K ** -0.5 * (S * q[:, t, ..., None]).sum(-2))
    o = torch.stack(outs, 1)                                                  # [B, T, H, V]
    z = (x @ p["in_proj_z.weight"].T).reshape(B, T, H, V)
    y = gated_out(o, z, p["norm.weight"], c.norm_eps).reshape(B, T, H * V)
    return y @ p["out_proj.weight"].T


def _linear_attention(p: dict, x: torch.Tensor, c, log_a: torch.Tensor, rotary: bool) -> torch.Tensor:
    """GLA / RetNet body: S_t = diag(a_t) S_{t-1} + k_t v_t^T, o_t = K^-1/2 S_t^T q_t, gated norm."""
    B, T, d = x.shape
    H = c.num_heads
    q, k, v = (x @ p[f"{n}_proj.weight"].T for n in "qkv")
    if c.use_short_conv:
        q, k, v = (causal_conv_silu(t, p[f"{n}_conv1d.weight"], p.get(f"{n}_conv1d.bias"))
                   for t, n in zip((q, k, v), "qkv"))
    K, V = q.shape[-1] // H, v.shape[-1] // H
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V)
    if rotary:
        q, k = rotate(q), rotate(k)
    a = torch.exp(log_a)                                                      # [B, T, H] or [B, T, H, K]
    if a.dim() == 3:
        a = a[..., None].expand(B, T, H, K)
    S = x.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = a[:, t, ..., None] * S + k[:, t, ..., None] * v[:, t, :, None, :]
        outs.append(K ** -0.5 * (S * q[:, t, ..., None]).sum(-2))
    o = torch.stack(outs, 1)
    z = (x @ p["g_proj.weight"].T).reshape(B, T, H, V)
    y = gated_out(o, z, p["g_norm_swish_gate.weight"], c.norm_eps).reshape(B, T, H * V)
    return y @ p["o_proj.weight"].T


def gla(p: dict, x: torch.Tensor, c) -> torch.Tensor:
    """GLA: per-key decay a_t = sigmoid(gk(x))^(1/16) (low-rank gk with a bias)."""
    B, T, _ = x.shape
    gk = (x @ p["gk_proj.0.weight"].T) @ p["gk_proj.1.weight"].T + p["gk_proj.1.bias"]
    log_a = F.logsigmoid(gk) / c.gate_logit_normalizer
    return _linear_attention(p, x, c, log_a.reshape(B, T, c.num_heads, -1), rotary=False)


def retnet(p: dict, x: torch.Tensor, c) -> torch.Tensor:
    """RetNet: fixed decay gamma_h = 1 - 2^(-5-h) per head, rotary q and k."""
    B, T, _ = x.shape
    gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(c.num_heads)], dtype=x.dtype)
    return _linear_attention(p, x, c, gamma.log().expand(B, T, -1), rotary=True)


def mamba2(p: dict, x: torch.Tensor, c) -> torch.Tensor:
    """Mamba-2 (SSD): h_t = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T, y_t = h_t^T C_t + D x_t,
    out = out_proj(rmsnorm(y * silu(z)) * w) (one group)."""
    Bsz, T, d = x.shape
    d_inner = c.expand * d
    H, P, N = d_inner // c.head_dim, c.head_dim, c.d_state
    proj = x @ p["in_proj.weight"].T
    z, xBC, dt = proj.split([d_inner, d_inner + 2 * N, H], dim=-1)
    xBC = causal_conv_silu(xBC, p["conv1d.weight"], p.get("conv1d.bias"))
    xs, Bm, Cm = xBC.split([d_inner, N, N], dim=-1)
    xs = xs.reshape(Bsz, T, H, P)
    dt = F.softplus(dt + p["dt_bias"])                                        # [B, T, H]
    A = -torch.exp(p["A_log"])
    h = x.new_zeros(Bsz, H, N, P)
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h \
            + Bm[:, t, None, :, None] * (dt[:, t, :, None] * xs[:, t])[:, :, None, :]
        ys.append((h * Cm[:, t, None, :, None]).sum(-2) + p["D"][:, None] * xs[:, t])
    y = torch.stack(ys, 1).reshape(Bsz, T, d_inner)
    y = rms(y * F.silu(z), c.norm_eps) * p["norm.weight"]
    return y @ p["out_proj.weight"].T


def mamba1(p: dict, x: torch.Tensor, c) -> torch.Tensor:
    """Mamba-1: h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t per channel, y = (C_t h_t + D u_t) silu(z)."""
    Bsz, T, d = x.shape
    d_inner, N = c.expand * d, c.d_state
    rank = math.ceil(d / 16) if c.dt_rank == "auto" else int(c.dt_rank)
    x_in, z = (x @ p["in_proj.weight"].T).chunk(2, dim=-1)
    u = causal_conv_silu(x_in, p["conv1d.weight"], p.get("conv1d.bias"))
    dt, Bm, Cm = (u @ p["x_proj.weight"].T).split([rank, N, N], dim=-1)
    delta = F.softplus(dt @ p["dt_proj.weight"].T + p["dt_proj.bias"])        # [B, T, d_inner]
    A = -torch.exp(p["A_log"])                                                # [d_inner, N]
    h = x.new_zeros(Bsz, d_inner, N)
    ys = []
    for t in range(T):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        ys.append((h * Cm[:, t, None, :]).sum(-1) + p["D"] * u[:, t])
    y = torch.stack(ys, 1) * F.silu(z)
    return y @ p["out_proj.weight"].T


def attn(p: dict, x: torch.Tensor, c) -> torch.Tensor:
    """Causal softmax attention with rotary q and k, GQA, optional sliding window; a loop over queries."""
    B, T, d = x.shape
    H = c.n_heads
    Hk = c.n_kv_heads or H
    D = c.head_dim or d // H
    q = rotate((x @ p["q_proj.weight"].T).reshape(B, T, H, D), c.rope_base)
    k = rotate((x @ p["k_proj.weight"].T).reshape(B, T, Hk, D), c.rope_base).repeat_interleave(H // Hk, 2)
    v = (x @ p["v_proj.weight"].T).reshape(B, T, Hk, D).repeat_interleave(H // Hk, 2)
    outs = []
    for t in range(T):
        start = 0 if c.window is None else max(0, t - c.window + 1)
        scores = torch.einsum("bhd,bjhd->bhj", q[:, t], k[:, start:t + 1]) * D ** -0.5
        outs.append(torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), v[:, start:t + 1]))
    return torch.stack(outs, 1).reshape(B, T, H * D) @ p["o_proj.weight"].T


LOOPS = {"gdn": gdn, "gla": gla, "retnet": retnet, "mamba2": mamba2, "mamba1": mamba1, "attn": attn}


# ---- the model around them ---------------------------------------------------------------------
class LoopLM(nn.Module):
    """embedding -> n x (x + mix(rmsnorm(x)); x + swiglu(rmsnorm(x))) -> rmsnorm -> tied head.

    Holds one parameter per entry of ``names_and_shapes`` (hybridzoo's state-dict names; dots
    replaced in the registered names), so ``load_state_dict`` of a hybridzoo state dict copies the
    weights. ``kind`` picks the loop; ``config`` is the hybridzoo HybridConfig (sizes only).
    """

    def __init__(self, config, shapes: dict[str, torch.Size]):
        super().__init__()
        self.config = config
        self.params = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(torch.zeros(s)) for n, s in shapes.items()})

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "/")]

    def mixer_params(self, i: int) -> dict:
        prefix = f"blocks/{i}/mixer/"
        return {n[len(prefix):].replace("/", "."): t for n, t in self.params.items() if n.startswith(prefix)}

    def copy_from(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                self.p(name).copy_(value)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = self.p("embed.weight")[ids]
        for i, kind in enumerate(c.layer_kinds()):
            h = rms(x, c.norm_eps) * self.p(f"blocks.{i}.mixer_norm.weight")
            x = x + LOOPS[kind](self.mixer_params(i), h, getattr(c, kind))
            h = rms(x, c.norm_eps) * self.p(f"blocks.{i}.mlp_norm.weight")
            gate, up, down = (self.p(f"blocks.{i}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            x = x + (F.silu(h @ gate.T) * (h @ up.T)) @ down.T
        return (rms(x, c.norm_eps) * self.p("norm.weight")) @ self.p("embed.weight").T

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups by the rule stated independently here: weight decay on the matrices of the
        projections, MLPs and convs; none on the embedding, norms, biases and SSM/decay
        parameters (A_log, D, dt_bias)."""
        decay, rest = [], []
        for name, param in self.params.items():
            last = name.split("/")[-1]
            no = (name == "embed/weight" or param.dim() < 2 or last in ("A_log", "D", "dt_bias"))
            (rest if no else decay).append(param)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
