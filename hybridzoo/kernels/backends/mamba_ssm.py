"""Adapters to mamba_ssm / causal_conv1d CUDA kernels, with hybridzoo's op signatures.

For side-by-side checks and benchmarks (``backend="mamba_ssm"``); CUDA only.

* ``selective_scan`` -> ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (its layout
  is channel-first ``[B, D, L]``: transposed here). mamba_ssm's scan takes no initial state: an
  ``initial_state`` raises a clear error (use ``backend="triton"`` or ``"reference"``).
* ``causal_conv1d`` -> ``causal_conv1d.causal_conv1d_fn`` (package ``causal-conv1d``), which
  takes an initial tail but cannot return the final one together with gradients: a final state
  is computed here from the inputs (the last W-1 of them), exactly. Documents packed in one row
  (``cu_seqlens``) go to its ``seq_idx`` (each token's document index, channel-last input), which
  takes no per-document initial tails: ``initial_state`` with ``cu_seqlens`` raises a clear error.
  mamba_ssm's selective scan takes no document boundaries: not declared in ``VARLEN_OPS``.
"""

from __future__ import annotations

import torch

OPS = ("selective_scan", "causal_conv1d")
VARLEN_OPS: set[str] = {"causal_conv1d"}  # through causal-conv1d's seq_idx; mamba_ssm's scan takes no boundaries


def _require(module: str, package: str):
    import importlib

    from hybridzoo.kernels._dispatch import BackendUnavailable

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise BackendUnavailable(f"backend 'mamba_ssm' needs the package {package!r}, which could not "
                                 f"be imported ({error}): pip install 'hybridzoo[mamba]'") from error


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, output_final_state=False):
    selective_scan_fn = _require("mamba_ssm.ops.selective_scan_interface", "mamba-ssm").selective_scan_fn

    if initial_state is not None:
        raise NotImplementedError("mamba_ssm's selective_scan_fn takes no initial state; "
                                  "use backend='triton' or backend='reference'")

    def channel_first(x):
        return None if x is None else x.transpose(1, 2).contiguous()

    def state_space(x):  # [B, T, N] -> [B, N, T]; [B, T, G, N] -> [B, G, N, T]
        return x.permute(0, 2, 1).contiguous() if x.dim() == 3 else x.permute(0, 2, 3, 1).contiguous()

    out = selective_scan_fn(channel_first(u), channel_first(delta), A, state_space(B), state_space(C),
                            D=D, z=channel_first(z), delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=output_final_state)
    if output_final_state:
        y, last = out
        return y.transpose(1, 2), last.float()
    return out.transpose(1, 2), None


def causal_conv1d(x, weight, bias=None, *, initial_state=None, output_final_state=False, activation=None,
                  cu_seqlens=None):
    causal_conv1d_fn = _require("causal_conv1d", "causal-conv1d").causal_conv1d_fn
    if cu_seqlens is not None:
        return _packed_conv(causal_conv1d_fn, x, weight, bias, initial_state, output_final_state, activation,
                            cu_seqlens)

    width = weight.shape[1]
    tail = None if initial_state is None else initial_state.transpose(1, 2).contiguous()
    y = causal_conv1d_fn(x.transpose(1, 2).contiguous(), weight, bias, initial_states=tail,
                         activation=activation)
    final = None
    if output_final_state:
        history = x if initial_state is None else torch.cat([initial_state, x], dim=1)
        if history.shape[1] < width - 1:
            history = torch.nn.functional.pad(history, (0, 0, width - 1 - history.shape[1], 0))
        final = history[:, history.shape[1] - (width - 1):]
    return y.transpose(1, 2), final


def _packed_conv(causal_conv1d_fn, x, weight, bias, initial_state, output_final_state, activation, cu_seqlens):
    """Documents packed in ``x [1, T, Dm]`` through causal-conv1d's ``seq_idx`` (channel-last ``x``:
    the transpose of the contiguous row, no copy); final tails ``[N_docs, W-1, Dm]`` from the inputs."""
    from hybridzoo.kernels.triton.conv import doc_final_states
    from hybridzoo.kernels.varlen import check_cu_seqlens, seq_idx_from_cu_seqlens

    if initial_state is not None:
        raise NotImplementedError("causal-conv1d's seq_idx takes no per-document initial tails (initial_state "
                                  "with cu_seqlens); use backend='triton' or backend='reference'")
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"causal_conv1d (mamba_ssm): with cu_seqlens the documents are packed in one row, "
                         f"x [1, total, Dm]; got x {tuple(x.shape)}")
    cu = check_cu_seqlens(cu_seqlens, x.shape[1], x.device)
    seq_idx = seq_idx_from_cu_seqlens(cu, x.shape[1]).to(torch.int32).reshape(1, -1).contiguous()
    y = causal_conv1d_fn(x.contiguous().transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation)
    final = doc_final_states(x, weight.shape[1], cu) if output_final_state else None
    return y.transpose(1, 2), final
