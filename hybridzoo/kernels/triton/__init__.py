"""hybridzoo's own Triton kernels (GPU; also runnable under ``TRITON_INTERPRET=1``).

``OPS`` lists the ops implemented here; ``backend="auto"`` uses this module on CUDA only for
those ops. None are implemented yet (see the Triton kernels issue).
"""

OPS: tuple[str, ...] = ()
