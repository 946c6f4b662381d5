"""hybridzoo: hybrid recurrent language models on shared scan and chunkwise kernels.

Subpackages (dependency direction is one way):
``kernels`` <- ``layers`` <- ``zoo`` <- ``training``.

``HybridLM`` and ``HybridConfig`` are imported lazily so that ``import hybridzoo`` stays cheap
and never imports an optional package.
"""

__version__ = "0.1.0"

__all__ = ["HybridLM", "HybridConfig", "__version__"]


def __getattr__(name):
    if name in ("HybridLM", "HybridConfig"):
        from hybridzoo import zoo

        return getattr(zoo, name)
    raise AttributeError(f"module 'hybridzoo' has no attribute {name!r}")
