"""kv_offload on the CPU: where stage 1 puts what it keeps, and what the 40% host-RAM guard counts.

On a CPU-only machine host and device are the same memory, so equal gradients cannot show that
anything moved. These tests check the placement decisions themselves: the per-layer state keeper
that ``seco_step`` builds (``_Layers``: its host, its pinning, the stores it asks for), every tensor
stage 1 keeps (a host copy, pinned exactly when CUDA is there), and the bytes the guard compares
with 40% of host RAM (the bytes really kept). Gradients are always compared with full backprop.
The GPU test that the kept tensors are pinned host memory is in test_seco.py
(``test_cuda_float32_matches_full_backprop[offload]``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridzoo.layers.attention import Attention, BlockKVState
from hybridzoo.training import seco_engine
from hybridzoo.training.seco_engine import SeCOOffloadError, offload_bytes, seco_step
from tests.training.test_seco import T, assert_close, data, full_backprop, hybrid, take_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CHUNK = 4


class RecordingLayers(seco_engine._Layers):
    """``_Layers`` that records each instance, the copies its ``save`` makes and its stores."""

    made: list[RecordingLayers] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, kept copy)
        self.stores: list[BlockKVState] = []
        RecordingLayers.made.append(self)

    def _copy(self, tensor):
        out = super()._copy(tensor)
        self.copies.append((tensor, out))
        return out

    def initial(self):
        states = super().initial()
        self.stores += [s for s in states if isinstance(s, BlockKVState)]
        return states


@pytest.fixture
def recording(monkeypatch):
    RecordingLayers.made = []
    monkeypatch.setattr(seco_engine, "_Layers", RecordingLayers)
    return RecordingLayers.made


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_seco_step_keeps_its_stage_one_state_where_kv_offload_says(offload, recording):
    model = hybrid(9)
    ids, labels = data(9)
    full_backprop(model, input_ids=ids, labels=labels)
    ref = take_grads(model)
    seco_step(model, {"input_ids": ids, "labels": labels}, CHUNK, kv_offload=offload, block_size=3)
    assert_close(take_grads(model), ref)  # against full backprop, with or without offload
    (layers,) = recording  # seco_step built one keeper, with the caller's kv_offload
    host = torch.device("cpu") if offload else None
    assert layers.host == host and layers.pin == (offload and torch.cuda.is_available())
    # the full-attention K/V stores are allocated on the host (pinned with CUDA) under offload,
    # with the activations otherwise
    assert layers.stores and all(s.store_device == host for s in layers.stores)
    assert all(s.pin_memory == layers.pin for s in layers.stores)
    assert all(s.block_size == 3 for s in layers.stores)  # the caller's prefix block, not the default
    # every boundary state kept is a fresh copy (never a view of a live activation), on the host
    assert layers.copies
    for source, kept in layers.copies:
        assert kept.device == (host or source.device) and kept.is_pinned() == layers.pin
        assert kept.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
        assert torch.equal(kept, source.detach())


def test_placement_with_cuda_present_pins_host_stores(monkeypatch):
    """A fake CUDA machine (only the decision runs, nothing is allocated): offloaded stores and
    boundary states go to pinned host memory; resident ones stay with the activations."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = hybrid(9)
    cuda = torch.device("cuda", 0)
    offloaded = seco_engine._Layers(model, T, 3, True, cuda)
    assert offloaded.host == torch.device("cpu") and offloaded.pin
    stores = [s for s in offloaded.initial() if s is not None]
    assert stores and all(s.store_device == torch.device("cpu") and s.pin_memory for s in stores)
    resident = seco_engine._Layers(model, T, 3, False, cuda)
    assert resident.host is None and not resident.pin
    assert all(s.store_device is None and not s.pin_memory for s in resident.initial() if s is not None)


def test_the_guard_counts_the_bytes_stage_one_keeps(monkeypatch, recording):
    """``offload_bytes`` (what the guard compares with 40% of host RAM) = the bytes of every tensor
    stage 1 keeps (boundary copies + K/V stores); the guard refuses one byte over 40% of RAM and
    accepts exactly 40%, before anything is allocated or any gradient written."""
    model = hybrid(10)
    ids, labels = data(10)
    batch = {"input_ids": ids, "labels": labels}
    counted = []
    original = seco_engine.offload_bytes
    monkeypatch.setattr(seco_engine, "offload_bytes", lambda *a: counted.append(original(*a)) or counted[-1])
    seco_step(model, batch, CHUNK, kv_offload=True)
    (layers,) = recording
    kept = sum(out.nbytes for _, out in layers.copies)
    # the stores hold the whole sequence (stage 1 skips the last chunk, the store is allocated whole)
    kept += sum(2 * ids.shape[0] * T * m.n_kv_heads * m.head_dim * 8
                for block in model.blocks if seco_engine._is_full_attention(block) for m in [block.mixer])
    assert counted == [kept] == [offload_bytes(model, 2, T, -(-T // CHUNK), torch.float64)]
    model.zero_grad(set_to_none=True)

    needed = counted[0]
    monkeypatch.setattr(seco_engine, "host_ram_bytes", lambda: needed * 5 // 2 - 5)  # 40% < needed
    with pytest.raises(SeCOOffloadError, match="kv_offload=False"):
        seco_step(model, batch, CHUNK, kv_offload=True)
    assert all(p.grad is None for p in model.parameters()) and len(recording) == 1
    monkeypatch.setattr(seco_engine, "host_ram_bytes", lambda: needed * 5 // 2)  # exactly 40%
    seco_step(model, batch, CHUNK, kv_offload=True)
    seco_step(model, batch, CHUNK)  # no offload: no guard at all, whatever the RAM
    assert len(counted) == 3



def test_the_guard_counts_no_positions_for_a_one_token_window(recording):
    """A sliding window of 1 keeps no K/V positions between chunks: ``offload_bytes`` counts
    exactly the bytes stage 1 keeps, with such a layer as with any other."""
    model = hybrid(10)
    (window,) = [b for b in model.blocks if b.mixer.kind == "attn" and not seco_engine._is_full_attention(b)]
    window.mixer = Attention(model.config.d_model, dataclasses.replace(model.config.attn, window=1)).double()
    ids, labels = data(10)
    seco_step(model, {"input_ids": ids, "labels": labels}, CHUNK, kv_offload=True)
    (layers,) = recording
    kept = sum(out.nbytes for _, out in layers.copies)
    kept += sum(2 * ids.shape[0] * T * m.n_kv_heads * m.head_dim * 8
                for block in model.blocks if seco_engine._is_full_attention(block) for m in [block.mixer])
    assert offload_bytes(model, 2, T, -(-T // CHUNK), torch.float64) == kept


def test_host_ram_is_this_machines_physical_memory():
    """The guard's denominator: /proc/meminfo's MemTotal (Linux), to within a page."""
    import os
    from pathlib import Path

    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo on this system")
    total_kb = next(int(line.split()[1]) for line in meminfo.read_text().splitlines()
                    if line.startswith("MemTotal:"))
    assert abs(seco_engine.host_ram_bytes() - total_kb * 1024) < os.sysconf("SC_PAGE_SIZE") + 1024


def test_the_keeper_slices_the_lm_head_of_a_hybrid_lm():
    """For a HybridLM, SeCO takes hidden states from the model and applies its LM head itself
    (in loss slices); a model whose forward has no ``return_hidden`` gets an identity head."""
    model = hybrid(9)
    layers = seco_engine._Layers(model, T, 3, False, torch.device("cpu"))
    assert layers.hidden and layers.head is model.lm_head
    assert layers.full == [seco_engine._is_full_attention(b) for b in model.blocks] and any(layers.full)
    assert (layers.length, layers.block_size, layers.device) == (T, 3, torch.device("cpu"))

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.blocks, self.lm_head = inner.blocks, inner.lm_head

        def forward(self, input_ids, state=None):
            raise AssertionError("not called")

    other = seco_engine._Layers(LogitsOnly(model), T, 3, False, torch.device("cpu"))
    assert not other.hidden and isinstance(other.head, torch.nn.Identity)


def test_the_refusal_states_the_sizes_in_gib(monkeypatch):
    """3 GiB needed on a 4 GiB host (40% = 1.6 GiB): the message gives both, and the fix."""
    monkeypatch.setattr(seco_engine, "offload_bytes", lambda *args: 3 * 2**30)
    monkeypatch.setattr(seco_engine, "host_ram_bytes", lambda: 4 * 2**30)
    with pytest.raises(SeCOOffloadError) as error:
        seco_engine._check_offload(hybrid(9), 2, T, 6, torch.float64)
    message = str(error.value)
    assert "would pin 3.00 GiB of host memory" in message and "batch 2 x 23 tokens" in message
    assert "more than 40% of this host's 4.0 GiB of RAM" in message and "kv_offload=False" in message
    monkeypatch.setattr(seco_engine, "host_ram_bytes", lambda: 8 * 2**30)  # 40% = 3.2 GiB: accepted
    seco_engine._check_offload(hybrid(9), 2, T, 6, torch.float64)


def test_boundary_copies_go_to_the_host_device_a_fake_host_shows_it():
    """A host that is not the compute device (the meta device stands in for it): with offload every
    kept copy lands on the host; without, a copy stays where its source is."""
    model = hybrid(9)
    offloaded = seco_engine._Layers(model, T, 3, True, torch.device("cpu"))
    offloaded.host = torch.device("meta")
    kept = offloaded._copy(torch.randn(2, 3, dtype=torch.float64))
    assert kept.device.type == "meta" and kept.shape == (2, 3) and kept.dtype == torch.float64
    assert not kept.is_pinned()  # pinned only with CUDA
    resident = seco_engine._Layers(model, T, 3, False, torch.device("cpu"))
    source = torch.randn(2, 3, device="meta")
    assert resident._copy(source).device.type == "meta"
    # stage 2 brings the saved states back to the compute device (meta standing in for it)
    ids, _ = data(9)
    layers = seco_engine._Layers(model, T, 3, True, torch.device("cpu"))
    with torch.no_grad():
        _, _, saved, _ = seco_engine._forward_chunks(model, layers, ids, None, None, seco_engine._chunks(T, 4))
    layers.device = torch.device("meta")
    states, leaves = layers.leaves(saved[2])
    assert leaves and all(leaf.device.type == "meta" and leaf.requires_grad and leaf.is_leaf
                          for layer in leaves for leaf in layer.values())
