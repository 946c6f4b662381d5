"""Training: ``LanguageModel`` (LightningModule), data modules, callbacks and the CLI.

Names are imported lazily (``from hybridzoo.training import LanguageModel``) so that importing
this package does not import Lightning until something from it is used.
"""

_EXPORTS = {
    "LanguageModel": "hybridzoo.training.module",
    "param_groups": "hybridzoo.training.module",
    "WarmupCosine": "hybridzoo.training.module",
    "ExportCallback": "hybridzoo.training.callbacks",
    "TokensPerSecond": "hybridzoo.training.callbacks",
    "TextDataModule": "hybridzoo.training.data",
    "MQARDataModule": "hybridzoo.training.data",
    "HybridLightningCLI": "hybridzoo.training.cli",
    "evaluate": "hybridzoo.training.evaluate",
    "SeCO": "hybridzoo.training.seco",
    "seco_step": "hybridzoo.training.seco_engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridzoo.training' has no attribute {name!r}")
