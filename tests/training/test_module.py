"""LanguageModel: parameter groups, the LR schedule, the training / validation steps."""

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from hybridzoo.training.module import LanguageModel, WarmupCosine, bytes_per_token_of, param_groups
from hybridzoo.utils import rel_err
from tests.zoo.tiny import tiny_config


def _batch(vocab, batch=2, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("tie", [True, False])
def test_param_groups_split(tie):
    torch.manual_seed(0)
    module = LanguageModel(tiny_config("mamba1 mamba2 gdn attn", tie_embeddings=tie))
    model = module.model
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # every distinct parameter exactly once
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})
    names_decay, names_no = set(decay["names"]), set(no_decay["names"])
    assert "embed.weight" in names_no
    assert ("lm_head.weight" in names_decay) == (not tie)  # a tied head is the embedding
    # known cases of each rule
    assert "blocks.0.mixer.A_log" in names_no and model.blocks[0].mixer.A_log.dim() == 2  # marked, 2-D
    assert "blocks.0.mlp.gate_proj.weight" in names_decay
    assert "blocks.3.mixer_norm.weight" in names_no
    for name, param in model.named_parameters():
        marked = getattr(param, "_no_weight_decay", False)
        assert (name in names_no) == (marked or param.dim() < 2 or param is model.embed.weight), name


def test_adamw_decays_only_the_decay_group():
    """With zero gradients Adam's update is 0, so one AdamW step multiplies decayed parameters
    by exactly (1 - lr * wd) and leaves the others unchanged."""
    torch.manual_seed(0)
    module = LanguageModel(tiny_config("mamba1 attn"), learning_rate=0.1, weight_decay=0.5, warmup_steps=0)
    optimizer = module.configure_optimizers()["optimizer"]
    assert not optimizer.defaults.get("fused")  # fused only on CUDA
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    for p in module.model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    decayed = set(optimizer.param_groups[0]["names"])
    for name, param in module.model.named_parameters():
        expected = before[name] * (1 - 0.1 * 0.5) if name in decayed else before[name]
        assert rel_err(param, expected) < 1e-6, name
    assert decayed and len(decayed) < len(before)


def test_warmup_cosine_schedule():
    s = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert s(0) == pytest.approx(0.1) and s(4) == pytest.approx(0.5) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5)           # half way through the cosine
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert WarmupCosine(0, math.inf, 0.1)(1000) == 1.0       # unknown length: constant after warmup
    assert WarmupCosine(0, 100, 0.0)(0) == pytest.approx(1.0)


def _unattached(module, logged):
    """Let ``training_step`` run without a Trainer: ``log`` records, ``optimizers`` gives one lr."""
    module.log = lambda name, value, **kwargs: logged.update({name: value})
    module.optimizers = lambda: SimpleNamespace(param_groups=[{"lr": 0.125}])
    return module


def test_training_step_is_the_shifted_cross_entropy():
    torch.manual_seed(0)
    logged = {}
    module = _unattached(LanguageModel(tiny_config("gdn attn")).double(), logged)
    batch = _batch(37)
    loss = module.training_step(batch, 0)
    logits = module.model(batch["input_ids"])[0]
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 37), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    assert loss.requires_grad and rel_err(loss, ref) < 1e-12
    assert logged["train/loss"] is loss and logged["train/lr"] == 0.125


def test_training_step_takes_the_seco_loss_when_the_callback_is_installed():
    """With ``module.seco`` set (the SeCO callback's setup does it) training_step returns that
    object's ``training_loss(model, batch)``, and does not run a full-sequence forward."""
    torch.manual_seed(0)
    module = _unattached(LanguageModel(tiny_config("gdn attn")), {})
    batch = _batch(37)
    calls, forwards = [], []
    sentinel = torch.tensor(1.5, requires_grad=True)
    module.seco = SimpleNamespace(training_loss=lambda model, b: calls.append((model, b)) or sentinel)
    module.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    assert module.training_step(batch, 0) is sentinel
    assert calls == [(module.model, batch)] and not forwards


class _Data(L.LightningDataModule):
    """A byte-like data module with the shared API (vocab_size, tokenizer None)."""

    def __init__(self, vocab=37, tokenizer=None):
        super().__init__()
        self.vocab_size, self.tokenizer = vocab, tokenizer
        self.train = [{k: v[i] for k, v in _batch(vocab, 8, 12, seed=1).items()} for i in range(8)]
        self.val = [{k: v[i] for k, v in _batch(vocab, 6, 12, seed=2).items()} for i in range(6)]

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=4)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=4)  # batches of 4 and 2: token-weighted mean needed


def _trainer(**kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def test_validation_metrics_are_token_weighted():
    torch.manual_seed(0)
    module = LanguageModel(tiny_config("gdn attn"))
    data = _Data()
    metrics = _trainer().validate(module, datamodule=data, verbose=False)[0]
    # independent: concatenate the whole held-out set and take one cross-entropy
    ids = torch.stack([row["input_ids"] for row in data.val])
    labels = torch.stack([row["labels"] for row in data.val])
    with torch.no_grad():
        logits = module.model(ids)[0][:, :-1]
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, 37), targets.reshape(-1), ignore_index=-100).item()
    mask = targets != -100
    acc = ((logits.argmax(-1) == targets) & mask).sum().item() / mask.sum().item()
    assert metrics["val/loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["val/ppl"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert metrics["val/acc"] == pytest.approx(acc, abs=1e-9)
    assert metrics["val/bpb"] == pytest.approx(loss / math.log(2), rel=1e-6)  # bytes: one byte per token


def test_bytes_per_token():
    assert bytes_per_token_of(None) is None
    assert bytes_per_token_of(_Data()) == 1.0
    assert bytes_per_token_of(_Data(tokenizer="some/dir")) is None
    from hybridzoo.training.tokenizers import ByteTokenizer
    assert bytes_per_token_of(_Data(tokenizer=ByteTokenizer())) == 1.0
    data = _Data(tokenizer="some/dir")
    data.bytes_per_token = 3.5
    assert bytes_per_token_of(data) == 3.5


def test_fit_steps_and_schedule():
    torch.manual_seed(0)
    module = LanguageModel(tiny_config("mamba2 attn"), learning_rate=1e-2, warmup_steps=2, min_lr_ratio=0.1)
    trainer = _trainer(max_steps=4, gradient_clip_val=1.0, num_sanity_val_steps=0)
    before = module.model.embed.weight.detach().clone()
    trainer.fit(module, datamodule=_Data())
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    # after 4 optimizer steps: warmup 2, cosine over the remaining 2 -> at the end, min_lr_ratio
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-2 * 0.1)
    assert trainer.global_step == 4
    assert not torch.equal(before, module.model.embed.weight)
    assert [s for s, _ in module.val_history] == [2, 4]  # two batches per epoch, val after each


def test_vocab_mismatch_is_a_clear_error():
    module = LanguageModel(tiny_config("attn"))
    with pytest.raises(ValueError, match="vocab_size 256 but the model config has vocab_size 37"):
        _trainer(max_steps=1).fit(module, datamodule=_Data(vocab=256))


class _FusedLanguageModel(LanguageModel):
    """Forces a fused AdamW (what CUDA gets) on CPU and records the gradient norm that each
    optimizer step used (read after the step, before the gradients are zeroed)."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        optimizer = torch.optim.AdamW(config["optimizer"].param_groups, lr=self.learning_rate, fused=True)
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            optimizer, config["lr_scheduler"]["scheduler"].lr_lambdas[0])
        self.norms = []
        return {**config, "optimizer": optimizer}

    def on_before_zero_grad(self, optimizer):
        grads = [p.grad.norm() for p in self.model.parameters() if p.grad is not None]
        if grads:
            self.norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())


def test_fused_adamw_is_clipped_under_bf16_mixed():
    """Lightning's mixed-precision plugin refuses to clip for a fused optimizer; LanguageModel
    clips itself when there is no GradScaler, so the step sees gradients of norm <= the limit."""
    torch.manual_seed(0)
    module = _FusedLanguageModel(tiny_config("gdn attn"), learning_rate=1e-2)
    _trainer(max_steps=2, precision="bf16-mixed", gradient_clip_val=1e-3, num_sanity_val_steps=0,
             limit_val_batches=0).fit(module, datamodule=_Data())
    assert module.norms and max(module.norms) <= 1e-3 * (1 + 1e-4)  # unclipped: ~2
