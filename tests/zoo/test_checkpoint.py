"""save_pretrained / from_pretrained: safetensors, bit-exact, and clear errors."""

import json
import warnings

import pytest
import torch

from hybridzoo import HybridLM
from hybridzoo.zoo import CheckpointError
from tests.zoo.tiny import tiny_config


@pytest.fixture
def model():
    torch.manual_seed(0)
    return HybridLM(tiny_config("mamba1 mamba2 gla retnet gdn attn"))


def test_round_trip_is_bit_exact(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = HybridLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.embed.weight
    ids = torch.randint(0, 37, (2, 9))
    assert torch.equal(model.eval()(ids)[0], loaded(ids)[0])


def test_untied_head_round_trips_and_dtype_device_options(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(tiny_config("gdn attn", tie_embeddings=False))
    model.save_pretrained(tmp_path)
    loaded = HybridLM.from_pretrained(tmp_path, dtype=torch.float64, device="cpu")
    assert loaded.lm_head.weight.dtype == torch.float64
    assert torch.equal(loaded.lm_head.weight.float(), model.lm_head.weight)


def test_missing_files(model, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        HybridLM.from_pretrained(tmp_path / "nope")
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors is missing"):
        HybridLM.from_pretrained(tmp_path)


def test_truncated_and_corrupted_weights(model, tmp_path):
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        HybridLM.from_pretrained(tmp_path)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        HybridLM.from_pretrained(tmp_path)


def test_config_that_does_not_match_the_tensors(model, tmp_path):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["d_model"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor '[\w.]+' has shape \(\d+(, \d+)*\), .*config.json implies"):
        HybridLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        HybridLM.from_pretrained(tmp_path)


def test_unknown_and_missing_keys(model, tmp_path):
    from safetensors.torch import load_file, save_file

    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"unexpected keys \['extra.weight'\]"):
        HybridLM.from_pretrained(tmp_path)
    del tensors["extra.weight"]
    del tensors["norm.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"missing keys \['norm.weight'\]"):
        HybridLM.from_pretrained(tmp_path)


def test_no_pickle_in_checkpoint(model, tmp_path):
    model.save_pretrained(tmp_path)
    head = (tmp_path / "model.safetensors").read_bytes()[:8]
    header_len = int.from_bytes(head, "little")
    assert 0 < header_len < 10**7  # a safetensors header, not a zip / pickle


def test_every_tensor_of_the_model_is_in_its_state_dict(model):
    # from_pretrained builds on the meta device and fills tensors from the file only: a buffer
    # left out of the state_dict (persistent=False) would come back uninitialised
    assert {name for name, _ in model.named_buffers()} <= set(model.state_dict())


# ---- atomic writes --------------------------------------------------------------------------------
def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_save_whose_rename_fails_leaves_the_previous_checkpoint(model, tmp_path, monkeypatch):
    from pathlib import Path

    model.save_pretrained(tmp_path)
    before = _files(tmp_path)
    torch.manual_seed(1)
    other = HybridLM(tiny_config("mamba1 mamba2 gla retnet gdn attn"))

    def fail(self, target):
        raise OSError(f"cannot rename {self.name} (simulated)")

    monkeypatch.setattr(Path, "replace", fail)
    monkeypatch.setattr(Path, "rename", fail)
    with pytest.raises(OSError, match="simulated"):
        other.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert _files(tmp_path) == before  # byte for byte, and no temporary file left
    loaded = HybridLM.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_write_atomically_never_leaves_a_partial_file_under_a_final_name(tmp_path):
    from hybridzoo.zoo.checkpoint import write_atomically

    (tmp_path / "a.bin").write_bytes(b"old a")
    (tmp_path / "b.bin").write_bytes(b"old b")
    seen = []

    def partial_then_crash(path):
        path.write_bytes(b"half of the new b")
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        raise RuntimeError("killed mid-write (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        write_atomically(tmp_path, {"a.bin": lambda p: p.write_bytes(b"new a"), "b.bin": partial_then_crash})
    assert seen == [["a.bin", "a.bin.tmp", "b.bin", "b.bin.tmp"]]  # written under temporary names
    assert _files(tmp_path) == {"a.bin": b"old a", "b.bin": b"old b"}  # nothing renamed, no .tmp left
    write_atomically(tmp_path, {"a.bin": lambda p: p.write_bytes(b"new a"), "c.bin": lambda p: p.write_bytes(b"c")})
    assert _files(tmp_path) == {"a.bin": b"new a", "b.bin": b"old b", "c.bin": b"c"}


def test_a_rename_failing_half_way_removes_every_temporary_file(tmp_path, monkeypatch):
    """The first file renamed, the second rename fails: the error comes through, the first file is
    new, the second keeps its old content, and no temporary file is left."""
    from pathlib import Path

    from hybridzoo.zoo.checkpoint import write_atomically

    (tmp_path / "a.bin").write_bytes(b"old a")
    (tmp_path / "b.bin").write_bytes(b"old b")
    replace = Path.replace

    def second_fails(self, target):
        if self.name == "b.bin.tmp":
            raise OSError("rename failed (simulated)")
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", second_fails)
    with pytest.raises(OSError, match="simulated"):
        write_atomically(tmp_path, {"a.bin": lambda p: p.write_bytes(b"new a"),
                                    "b.bin": lambda p: p.write_bytes(b"new b")})
    assert _files(tmp_path) == {"a.bin": b"new a", "b.bin": b"old b"}


# ---- loading: dtypes, strict JSON, a file instead of its folder -----------------------------------
def _rewrite_tensor(directory, name, change):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = change(tensors[name])
    save_file(tensors, path)


def test_an_integer_tensor_where_a_float_weight_is_expected_is_an_error_unless_cast(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(tiny_config("mamba2 attn"))
    model.save_pretrained(tmp_path)
    name = next(n for n in model.state_dict() if n.endswith("A_log"))
    _rewrite_tensor(tmp_path, name, lambda t: t.to(torch.int32))  # A_log ~ [0.4, 2.7] -> whole numbers
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored as int32, the model expects float32.*"
                                              r"dtype_cast=True"):
        HybridLM.from_pretrained(tmp_path)
    loaded = HybridLM.from_pretrained(tmp_path, dtype_cast=True)  # asked for: cast
    assert torch.equal(loaded.state_dict()[name], model.state_dict()[name].to(torch.int32).float())


def test_a_model_saved_in_bf16_loads_exactly_in_float32_or_bf16(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(tiny_config("gdn attn")).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    widened = HybridLM.from_pretrained(tmp_path)
    as_saved = HybridLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert widened.state_dict()[name].dtype == torch.float32
        assert torch.equal(widened.state_dict()[name], tensor.float()), name  # bf16 -> float32 is exact
        assert as_saved.state_dict()[name].dtype == torch.bfloat16
        assert torch.equal(as_saved.state_dict()[name], tensor), name


def test_a_float64_file_loaded_as_float64_stays_exact(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(tiny_config("gdn attn")).double()
    with torch.no_grad():
        model.norm.weight.add_(1e-12)  # not representable in float32
    model.save_pretrained(tmp_path)
    loaded = HybridLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert torch.equal(loaded.norm.weight, model.norm.weight)


def _no_constants(name):
    raise AssertionError(f"non-standard JSON literal {name}")


def test_config_json_is_strict_json_and_infinity_round_trips(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(tiny_config("mamba2 attn"))
    assert model.config.mamba2.time_step_limit == (0.0, float("inf"))
    model.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text, parse_constant=_no_constants)["mamba2"]["time_step_limit"] == [0.0, "inf"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a strict file loads without a warning
        assert HybridLM.from_pretrained(tmp_path).config == model.config


def test_an_old_config_with_infinity_loads_with_a_warning_and_nan_or_duplicates_are_refused(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(tiny_config("mamba2 attn"))
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    strict = path.read_text()
    path.write_text(strict.replace('"inf"', "Infinity"))  # what earlier versions wrote
    with pytest.warns(UserWarning, match=r"config.json holds the non-standard JSON literal Infinity.*Re-save"):
        assert HybridLM.from_pretrained(tmp_path).config == model.config
    path.write_text(strict.replace('"norm_eps": 1e-06', '"norm_eps": NaN'))
    assert "NaN" in path.read_text()
    with pytest.raises(CheckpointError, match=r"config.json is not standard JSON: it holds the literal NaN"):
        HybridLM.from_pretrained(tmp_path)
    path.write_text(strict.replace('"d_model":', '"d_model": 8, "d_model":', 1))
    with pytest.raises(CheckpointError, match=r"config.json is not valid: the key\(s\) \['d_model'\] appear more"):
        HybridLM.from_pretrained(tmp_path)


def test_the_weights_or_config_file_stand_for_their_folder(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    for name in ("model.safetensors", "config.json"):
        loaded = HybridLM.from_pretrained(tmp_path / "ckpt" / name)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    (tmp_path / "ckpt" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"notes.txt is a file; a checkpoint is the directory .*ckpt\)"):
        HybridLM.from_pretrained(tmp_path / "ckpt" / "notes.txt")
