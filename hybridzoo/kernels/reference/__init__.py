"""Pure-PyTorch reference kernels: any device, any dtype (float64 included). THE SPEC.

Each file holds one op family: the step loop (ground truth), the single-token step used for
decoding, and the fast-but-plain forms (scans, chunkwise) that are tested against the loop.
"""

from hybridzoo.kernels.reference.attention import attention, attention_loop, attention_step, merge_attention
from hybridzoo.kernels.reference.conv import causal_conv1d, causal_conv1d_loop, causal_conv1d_step
from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule, delta_rule_loop, delta_rule_step
from hybridzoo.kernels.reference.linear_attn import (
    chunk_linear_attn,
    gla_decay_grad,
    linear_attn_loop,
    linear_attn_step,
)
from hybridzoo.kernels.reference.segsum import segsum
from hybridzoo.kernels.reference.selective_scan import (
    selective_scan,
    selective_scan_loop,
    selective_scan_step,
)

OPS = ("chunk_linear_attn", "chunk_delta_rule", "selective_scan", "attention", "causal_conv1d")
# the ops that take packed documents (cu_seqlens): all of them (see hybridzoo.kernels.varlen)
VARLEN_OPS = set(OPS)

__all__ = [
    "OPS",
    "VARLEN_OPS",
    "attention",
    "attention_loop",
    "attention_step",
    "merge_attention",
    "causal_conv1d",
    "causal_conv1d_loop",
    "causal_conv1d_step",
    "chunk_delta_rule",
    "delta_rule_loop",
    "delta_rule_step",
    "chunk_linear_attn",
    "gla_decay_grad",
    "linear_attn_loop",
    "linear_attn_step",
    "segsum",
    "selective_scan",
    "selective_scan_loop",
    "selective_scan_step",
]
