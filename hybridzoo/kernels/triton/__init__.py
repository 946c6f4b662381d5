"""hybridzoo's own Triton kernels (GPU; also runnable under ``TRITON_INTERPRET=1``).

``OPS`` lists the ops implemented here; ``backend="auto"`` uses this module on CUDA for those
ops. ``VARLEN_OPS`` lists those whose kernels take packed documents (``cu_seqlens=``, see
:mod:`hybridzoo.kernels.varlen`); a packed call of any other op is refused by the dispatcher. Each op is an autograd Function with Triton forward and backward kernels and exactly the
signature of its reference in :mod:`hybridzoo.kernels.reference` (float16 / bfloat16 / float32
inputs; float64 raises an error pointing to ``backend="reference"``).
"""

from hybridzoo.kernels.triton.delta_rule import chunk_delta_rule  # noqa: E402
from hybridzoo.kernels.triton.linear_attn import chunk_linear_attn  # noqa: E402
from hybridzoo.kernels.triton.selective_scan import selective_scan  # noqa: E402
from hybridzoo.kernels.triton.conv import causal_conv1d  # noqa: E402

OPS: tuple[str, ...] = ("chunk_linear_attn", "chunk_delta_rule", "selective_scan", "causal_conv1d")
# the ops whose kernels take packed documents (cu_seqlens=); each kernel adds its name when it does
VARLEN_OPS: set[str] = {"chunk_delta_rule", "chunk_linear_attn", "selective_scan", "causal_conv1d"}
