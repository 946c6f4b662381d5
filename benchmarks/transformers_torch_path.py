"""transformers' own pure-PyTorch functions, found under the wrappers it binds them in.

transformers binds its kernel entry points (the gated delta rule, Mamba's scans and
``causal_conv1d``) to wrappers that dispatch to fla, mamba_ssm, causal_conv1d or a Hugging Face
hub kernel. Up to 5.24 a wrapper is a function made with ``functools.wraps`` (the torch function
is its ``__wrapped__``). 5.25 requires the ``kernels`` package, whose decorator turns the wrapper
into an instance of an ``nn.Module`` subclass whose ``forward`` calls the function it closes over.
:func:`torch_function` peels both layers; the CPU delta-rule benchmark and the parity tests use it
to call transformers' torch code and nothing else.
"""

from __future__ import annotations

import inspect


def torch_function(obj):
    """The plain Python function under ``obj``.

    Follows ``__wrapped__`` chains (``inspect.unwrap``) and, for an object whose class's
    ``forward`` closes over one callable (``kernels``' function modules: ``func``), that callable;
    repeats until a plain function is reached. Raises ``TypeError`` when ``obj`` hides none.
    """
    start = obj
    for _ in range(16):
        obj = inspect.unwrap(obj)
        if inspect.isfunction(obj):
            return obj
        forward = getattr(type(obj), "forward", None)
        inner = None
        if inspect.isfunction(forward):
            closed = {name: value for name, value in inspect.getclosurevars(forward).nonlocals.items()
                      if callable(value) and not inspect.isclass(value)}
            inner = closed.get("func", next(iter(closed.values())) if len(closed) == 1 else None)
        if inner is None:
            raise TypeError(f"torch_function: no plain function found under {start!r} (stopped at {obj!r})")
        obj = inner
    raise TypeError(f"torch_function: {start!r} is wrapped more than 16 levels deep")
