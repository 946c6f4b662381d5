"""Every Triton kernel of chunk_linear_attn (with and without packed documents), chunk_delta_rule and
the SeCO prefix backward compiles for sm_90 (H100/H200), bf16 and fp32, at the largest head sizes
the ops take, within the 227 KB shared-memory limit; the conv and selective-scan kernels compile
without register spills at every launch setting they may run with.

No GPU needed: ``scripts/kernel_resources.py --all`` compiles each kernel for
``GPUTarget("cuda", 90, 32)`` and assembles it with the ptxas that ships with Triton. (A K = 128
delta-rule kernel once overflowed shared memory and was only caught on the device.) Runs in a
subprocess because this test session sets TRITON_INTERPRET=1, under which kernels are not compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"  # the wheel ships one


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])  # two halves, so two test workers share the compiles
def test_every_kernel_compiles_for_sm90_within_shared_memory(dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "hybridzoo-sm90-triton-cache")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), "--all", "--dtype", dtype],
                            capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in result.stdout.splitlines() if " shared " in line]
    # 18 kernels, the WY forward's second variant (HAS_TM: the backward's, Tm read), the split
    # state kernels (delta_rule_split) at each of the 2 candidates kept at K = 256, and the 9
    # linear-attention kernels' packed-documents forms (VARLEN)
    assert len(lines) == 32 and all(line.split(" shared ")[0].split()[-1] == dtype for line in lines), \
        result.stdout + result.stderr
    assert result.returncode == 0, "\n".join(line for line in lines if "error" in line or "OVER" in line)


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_elementwise_kernels_do_not_spill_at_any_launch_setting():
    """The conv and selective-scan kernels at their fixed GPU setting and at every autotuning
    candidate compile for sm_90 without register spills (``kernel_resources.py --spills``; the
    documented allowances of ``SPILL_ALLOWED``: the selective scan's backward candidates, measured
    fastest with their spills). The conv backward's earlier tile spilled 15 KB per thread and ran 12x
    slower than causal_conv1d_fn on an H200."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "hybridzoo-sm90-triton-cache")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), "--spills"],
                            capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in result.stdout.splitlines() if " spills " in line]
    assert len(lines) >= 15, result.stdout + result.stderr
    assert result.returncode == 0, "\n".join(line for line in lines if "SPILLS" in line or "error" in line)


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_ptx_fingerprint_ignores_line_numbers_and_sees_launch_changes(tmp_path):
    """``kernel_resources.ptx_fingerprint`` (the evidence that a kernel refactor changes no launch):
    the same kernel gives the same hash from source shifted by blank lines, and a different hash
    at another launch setting."""
    script = f"""
import importlib.util, sys
sys.path.insert(0, {str(ROOT / 'scripts')!r})
import kernel_resources as kr
name, kernel, types, constexprs, warps, stages = next(iter(kr.elementwise_settings()))
first = kr.ptx_fingerprint(kernel, types, constexprs, warps, stages)
# the kernel's module again from a copy of its source with blank lines at the top
path = kernel.fn.__code__.co_filename
shifted = {str(tmp_path / 'shifted.py')!r}
open(shifted, 'w').write(chr(10) * 7 + open(path).read())
spec = importlib.util.spec_from_file_location(kernel.fn.__module__, shifted)
module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module; spec.loader.exec_module(module)
moved = getattr(module, kernel.fn.__name__)
assert moved.fn.__code__.co_firstlineno == kernel.fn.__code__.co_firstlineno + 7
assert kr.ptx_fingerprint(moved, types, constexprs, warps, stages) == first, 'line numbers changed the hash'
other = 4 if warps != 4 else 8
assert kr.ptx_fingerprint(kernel, types, constexprs, other, stages) != first, 'warps did not change the hash'
print('OK')
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr


_INLINE = """
import triton
import triton.language as tl
{helper}

@triton.jit
def kern(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(x + i, mask=m, other=0.0)
    for j in tl.static_range(2):
        a = {step}
    tl.store(y + i, a, mask=m)
"""


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_ptx_fingerprint_is_blind_to_a_body_moved_into_a_jit_helper(tmp_path):
    """Moving part of a kernel into a ``@triton.jit`` helper adds the ``$L__tmp`` labels that mark
    the inlined scope for the debug sections; the instructions, and so the fingerprint, stay."""
    (tmp_path / "inline_mod.py").write_text(_INLINE.format(helper="", step="tl.exp(a) * 2.0 + tl.sum(a, axis=0)"))
    (tmp_path / "helper_mod.py").write_text(_INLINE.format(
        helper="\n@triton.jit\ndef _part(a):\n    return tl.exp(a) * 2.0 + tl.sum(a, axis=0)\n",
        step="_part(a)"))
    script = f"""
import re, sys
sys.path.insert(0, {str(ROOT / 'scripts')!r}); sys.path.insert(0, {str(tmp_path)!r})
import kernel_resources as kr, inline_mod, helper_mod
types = {{"x": "*fp32", "y": "*fp32", "n": "i32"}}
labels = [len(re.findall(r"^\\$L__tmp\\d+:", kr.compile_sm90(m.kern, types, {{"BLOCK": 128}}).asm["ptx"], re.M))
          for m in (inline_mod, helper_mod)]
assert labels[1] > labels[0], labels  # the helper's scope is marked
prints = [kr.ptx_fingerprint(m.kern, types, {{"BLOCK": 128}}) for m in (inline_mod, helper_mod)]
assert prints[0] == prints[1], prints
print('OK')
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_selective_scan_backward_atomics_are_relaxed():
    """The selective scan's backward adds dB and dC with relaxed atomics: Triton's default
    (acq_rel) compiles for sm_90 to an atomic that waits for its result behind a full memory
    barrier and an L1 invalidation, 8 times per 8-token time block (the default)."""
    script = """
import sys
sys.path.insert(0, 'scripts')
import kernel_resources as kr
name, kernel, types, constexprs, warps, stages = next(
    s for s in kr.elementwise_settings() if s[0].startswith('selective_scan _bwd_kernel BLOCK_T=8 BLOCK_D=4 warps=1'))
ptx = kr.compile_sm90(kernel, types, constexprs, warps, stages).asm['ptx']
atomics = [line for line in ptx.splitlines() if 'atom.global' in line or 'red.global' in line]
print(len(atomics), sum('relaxed' in line for line in atomics))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "hybridzoo-sm90-triton-cache")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    total, relaxed = map(int, result.stdout.split()[-2:])
    assert total > 0 and relaxed == total, result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not (PTXAS.parent / "nvdisasm").exists(), reason="this Triton wheel ships no nvdisasm")
def test_loop_counts_read_the_selective_scan_backwards_time_block_loop():
    """``kernel_resources.py --loops`` finds the backward's time-block loop in its sm_90 SASS and
    counts it by class: every class adds up to the loop, and the loop holds at least the two
    exponentials per tile element that the math needs (an 8 x 16 x 4 tile on 32 lanes: 32 MUFU)."""
    script = """
import sys, json
sys.path.insert(0, 'scripts')
import kernel_resources as kr
name, kernel, types, constexprs, warps, stages = next(
    s for s in kr.elementwise_settings() if s[0] == 'selective_scan _bwd_kernel BLOCK_T=8 BLOCK_D=4 warps=1')
print(json.dumps(kr.sass_loop(kr.compile_sm90(kernel, types, constexprs, warps, stages).asm['cubin'])))
"""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "hybridzoo-sm90-triton-cache")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0 < counts["loop"] < counts["instructions"]
    assert sum(counts["classes"].values()) == counts["loop"] == sum(counts["opcodes"].values())
    assert counts["classes"]["special"] >= 32 and counts["classes"]["shuffle"] > 0 and counts["classes"]["fp32"] > 0
    assert counts["opcodes"].get("BRA", 0) >= 1
