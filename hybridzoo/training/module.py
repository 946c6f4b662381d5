"""``LanguageModel``: the LightningModule around :class:`~hybridzoo.zoo.HybridLM`.

AdamW in two parameter groups (no weight decay on embeddings, norms, biases, any 1-D
parameter and every parameter a mixer marked ``_no_weight_decay``, e.g. Mamba's ``A_log``),
linear warmup then cosine decay to ``min_lr_ratio · learning_rate`` over the run's optimizer
steps. Logs ``train/loss``, ``train/lr``, and per validation run ``val/loss``, ``val/ppl``,
``val/acc`` (next-token accuracy over the labelled positions: the MQAR accuracy for MQAR data)
and ``val/bpb`` (bits per byte) when the data module says how many bytes a token holds.
Gradient clipping and precision are the Trainer's (``gradient_clip_val``, ``precision``).
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn

from hybridzoo.zoo import HybridConfig, HybridLM


class WarmupCosine:
    """LR multiplier at optimizer step ``step`` (0-based): ``(step + 1) / warmup_steps`` during
    warmup, then a cosine from 1 down to ``min_ratio`` at ``total_steps``, then ``min_ratio``.

    ``total_steps = inf`` (unknown run length) keeps the multiplier at 1 after warmup.
    A class, not a closure, so ``LambdaLR.state_dict`` stores it with the checkpoint.
    """

    def __init__(self, warmup_steps: int, total_steps: float, min_ratio: float):
        self.warmup_steps = int(warmup_steps)
        self.total_steps = total_steps
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not math.isfinite(self.total_steps):
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split ``model``'s parameters into ``[{decayed}, {weight_decay 0}]`` for AdamW.

    No decay for: parameters marked ``_no_weight_decay``, every parameter with fewer than two
    dimensions (biases, norm weights, per-head scalars), and embedding tables (a tied LM head
    is the embedding table and appears once). Each group also carries ``names`` (for
    inspection; torch optimizers ignore unknown keys).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = {"names": [], "params": []}, {"names": [], "params": []}
    for name, param in model.named_parameters():  # tied parameters are listed once
        if not param.requires_grad:
            continue
        skip = getattr(param, "_no_weight_decay", False) or param.dim() < 2 or id(param) in embeddings
        group = no_decay if skip else decay
        group["names"].append(name)
        group["params"].append(param)
    return [{**decay, "weight_decay": weight_decay}, {**no_decay, "weight_decay": 0.0}]


class LanguageModel(L.LightningModule):
    """Causal LM training around ``HybridLM(config)``.

    Args:
        config: the model (``model.config`` in a recipe). Its ``vocab_size`` must match the
            data (``hybridzoo fit`` sets it from the data module).
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay of the matrices (see :func:`param_groups`).
        warmup_steps: optimizer steps of linear warmup.
        min_lr_ratio: final learning rate as a fraction of the peak (cosine end point).
        betas: AdamW betas.

    Batches are dicts ``{"input_ids": [B, T] int64, "labels": [B, T] int64}`` (labels are
    shifted inside HybridLM; -100 = no loss), and for packed documents also
    ``"position_ids": [B, T]`` restarting at 0 at each document (or ``"cu_seqlens"``, int32
    ``[N + 1]``, for a single packed row): both are passed on to ``HybridLM``, which then resets
    every state at each boundary.
    """

    def __init__(self, config: HybridConfig, learning_rate: float = 3e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 100, min_lr_ratio: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)):
        super().__init__()
        if isinstance(config, dict):
            config = HybridConfig.from_dict(config)
        if warmup_steps < 0 or not 0 <= min_lr_ratio <= 1 or learning_rate <= 0:
            raise ValueError(f"LanguageModel: need learning_rate > 0, warmup_steps >= 0 and "
                             f"0 <= min_lr_ratio <= 1; got {learning_rate}, {warmup_steps}, {min_lr_ratio}")
        self.config = config
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.betas = tuple(betas)
        self.model = HybridLM(config)
        # hyperparameters go into every Lightning checkpoint (config as a plain dict)
        self.save_hyperparameters({"config": config.to_dict(), "learning_rate": learning_rate,
                                   "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                                   "min_lr_ratio": min_lr_ratio, "betas": list(self.betas)})
        self.val_history: list[tuple[int, float]] = []  # (global step, val loss) of each run
        self._val_sums: torch.Tensor | None = None

    # ---- setup --------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab = getattr(datamodule, "vocab_size", None)
        if vocab is not None and int(vocab) != self.config.vocab_size:
            raise ValueError(f"the data has vocab_size {vocab} but the model config has vocab_size "
                             f"{self.config.vocab_size}; set model.config.vocab_size to {vocab}")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **documents):
        return self.model(input_ids, labels=labels, **documents)

    # ---- steps --------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        seco = getattr(self, "seco", None)  # set by the SeCO callback: a chunked, exact step
        if seco is not None:
            loss = seco.training_loss(self.model, batch)
        else:
            _, _, loss = self.model(batch["input_ids"], labels=batch["labels"], **documents_of(batch))
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=batch_size)
        return loss

    def on_validation_epoch_start(self) -> None:
        # [sum of token losses, labelled tokens, correct argmax predictions], float64
        self._val_sums = torch.zeros(3, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits, _, loss = self.model(batch["input_ids"], labels=batch["labels"], **documents_of(batch))
        self._val_sums += validation_sums(logits, batch["labels"], loss, batch.get("position_ids"))
        return loss

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        if sums[1] == 0:
            return
        values = validation_metrics(sums, bytes_per_token_of(getattr(self.trainer, "datamodule", None)))
        self.val_history.append((self.global_step, values["loss"]))
        metrics = {_LOGGED_NAMES[name]: value for name, value in values.items()}
        if not self.trainer.sanity_checking:  # Lightning drops what is logged during the sanity check
            self.log("val/loss", metrics.pop("val/loss"), prog_bar=True)
            self.log_dict(metrics)

    # ---- optimizer ----------------------------------------------------------------------
    def configure_optimizers(self):
        groups = param_groups(self.model, self.weight_decay)
        # fused AdamW on CUDA, except under a GradScaler (16-mixed), which must unscale first
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        fused = scaler is None and all(p.device.type == "cuda" for group in groups for p in group["params"])
        optimizer = torch.optim.AdamW(groups, lr=self.learning_rate, betas=self.betas,
                                      fused=fused or None)
        total = float(self.trainer.estimated_stepping_batches) if self._trainer is not None else math.inf
        schedule = WarmupCosine(self.warmup_steps, total, self.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning's mixed-precision plugin refuses to clip for a fused optimizer (it assumes
        a GradScaler unscales inside the step); without a scaler (bf16-mixed, 32-true) the
        gradients are already unscaled, so a fused AdamW is clipped here directly."""
        if not optimizer.defaults.get("fused") or not gradient_clip_val:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)


def documents_of(batch: dict) -> dict:
    """The document boundaries of a batch as ``HybridLM`` keywords: ``position_ids`` and / or
    ``cu_seqlens`` where the batch has them (nothing for a batch of plain rows)."""
    return {key: batch[key] for key in ("position_ids", "cu_seqlens") if batch.get(key) is not None}


# the names LanguageModel logs the metrics of validation_metrics under
_LOGGED_NAMES = {"loss": "val/loss", "perplexity": "val/ppl", "accuracy": "val/acc", "bits_per_byte": "val/bpb"}


def validation_sums(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One batch's ``[loss · n, n, correct]`` (float64, on the logits' device): ``n`` labelled
    next-token positions, ``correct`` of them predicted by the argmax. ``logits [B, T, V]``,
    ``labels [B, T]`` (unshifted, -100 ignored), ``loss`` the batch's mean loss (a scalar),
    ``position_ids [B, T]`` of packed documents (a label at a document's first token, position
    0, is not predicted: the model's loss skips it too). Summed over batches (and ranks), they
    give :func:`validation_metrics`."""
    targets = labels[:, 1:]
    mask = targets != -100
    if position_ids is not None:
        mask = mask & (position_ids[:, 1:] != 0)
    count = mask.sum()
    correct = ((logits[:, :-1].argmax(-1) == targets) & mask).sum()
    return torch.stack([loss.double() * count, count.double(), correct.double()])


def validation_metrics(sums: torch.Tensor, bytes_per_token: float | None) -> dict[str, float]:
    """``loss`` (mean over the labelled positions, nats), ``perplexity`` (``exp`` of the loss,
    capped at ``e^80``), ``accuracy`` and, when ``bytes_per_token`` is known, ``bits_per_byte``,
    from the summed :func:`validation_sums` (at least one labelled position)."""
    loss = float(sums[0] / sums[1])
    metrics = {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "accuracy": float(sums[2] / sums[1])}
    if bytes_per_token:
        metrics["bits_per_byte"] = loss / math.log(2) / bytes_per_token
    return metrics


def bytes_per_token_of(datamodule) -> float | None:
    """How many bytes of text one token holds on average, if known: the data module's
    ``bytes_per_token`` attribute, else 1.0 for the byte-level tokenizer (a ``tokenizer`` that
    is None or has ``vocab_size`` 256 and no files), else None (MQAR and other synthetic data
    have no bytes; a subword tokenizer needs ``bytes_per_token``)."""
    if datamodule is None:
        return None
    value = getattr(datamodule, "bytes_per_token", None)
    if value:
        return float(value)
    if not hasattr(datamodule, "tokenizer"):
        return None
    tokenizer = datamodule.tokenizer
    if tokenizer is None or type(tokenizer).__name__ == "ByteTokenizer":
        return 1.0
    return None
