"""Launch-side helpers shared by every Triton op: interpreter detection, loop bounds, dot
precision, launch width, autotuning, output buffers and head-group sums.

Modules call these through the module (``launch.empty(...)``), so a test or a probe that sets
``launch.POISON_OUTPUTS`` or replaces ``launch.warps`` reaches every op at once.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton

POISON_OUTPUTS = False  # tests set this: every buffer starts as NaN, so an unwritten element shows

# Warps of a chunk-kernel launch whose tiles are 64 wide on every head dimension: with Triton's
# default of 4, ptxas spills up to 3.4 KB per thread in the linear-attention backward at
# K = V = 128 in bf16; with 8 none spills more than 260 B (``scripts/kernel_resources.py``).
# Narrower tiles keep 4: a Mamba-2 MQAR model (K = 64, V = 32: [64, 64] x [64, 32] dots) hit an
# illegal memory access on an H200 with 8 warps (Triton 3.6), and 4
# is the setting every such shape was verified with.
WARPS = 8

# Autotuned kernels (:func:`autotuned`) pick their launch settings on a GPU; with AUTOTUNE off
# (``HYBRIDZOO_AUTOTUNE=0``, or a probe / benchmark setting it) and under the interpreter they run
# with the fixed settings their launcher gives (:func:`run`). Results do not depend on it.
AUTOTUNE = os.environ.get("HYBRIDZOO_AUTOTUNE", "1") != "0"
TUNED: dict = {}  # "<module>.<kernel>" -> its autotuner (benchmarks report the configs they chose)


def interpret() -> bool:
    """Whether kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter_bf16() -> None:
    """Make bfloat16 under Triton's interpreter compute what a GPU computes.

    The interpreter (Triton 3.6) keeps bfloat16 tensors as ``uint16`` and

    * its ``create_dot`` converts only 8-bit float operands, so a bfloat16 ``tl.dot`` multiplies
      raw bit patterns (values ~1e10; triton-lang/triton#11584, "not supported yet"): the
      operands are widened to float32 first, which is exact and what tensor cores compute
      (bf16 products exact, float32 sums);
    * its float32 -> bfloat16 cast truncates toward zero, where compiled kernels round to
      nearest even: a bias that grows along a recurrence (the delta rule's bf16 errors came out
      ~27x its fp16 errors instead of ~8x). The cast rounds to nearest even here too.

    With both, every kernel's bfloat16 path runs, and is tested, on the CPU as on a GPU. Applied
    once when the interpreter is on; compiled kernels are untouched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        bits = np.ascontiguousarray(x.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_bf16(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # nearest even
        nan = np.isnan(src.data)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # NaN stays a (quiet) NaN
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    create_dot_bf16.widens_bf16 = True
    builder.create_dot, builder.cast_impl = create_dot_bf16, cast_bf16


def _interpreter_bool_masks() -> None:
    """Give the interpreter's masked loads and stores boolean masks, as compiled kernels have.

    The interpreter computes ``block_mask & scalar_mask`` (an ``int1`` block and an ``int1``
    scalar, e.g. ``(kk < K) & (row < T)`` in the per-key linear-attention kernels) as int32 data
    under an ``int1`` type. Triton 3.6's masked load took that; Triton 3.9's (a C++ routine)
    raises ``mask has unsupported dtype``. Compiled kernels are untouched (there the value is an
    ``i1``), so this changes no PTX."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_masked_load, "bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask is None or mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, mask.dtype)

    def masked_load(self, ptrs, mask, *rest):
        return load(self, ptrs, as_bool(mask), *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        return store(self, ptrs, value, as_bool(mask), *rest)

    masked_load.bool_masks = True
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store


if interpret():
    _interpreter_bf16()
    _interpreter_bool_masks()


def require_usable(op: str, device: torch.device, *tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the way out when ``op``'s Triton kernels cannot take these
    inputs: a float64 tensor (the kernels compute in float32; the reference backend takes float64)
    or a device other than CUDA outside the interpreter."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        raise ValueError(f"{op} (triton): float64 inputs are not supported by the Triton kernels; "
                         "use backend='reference' for float64")
    if device.type != "cuda" and not interpret():
        raise ValueError(f"{op} (triton): inputs must be on a CUDA device (got {device}); "
                         "use backend='reference' on CPU, or set TRITON_INTERPRET=1 before importing triton")


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of the CUDA ``device`` (cached per device index)."""
    return _sm_count_of(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def loop_count(n: int) -> int:
    """A sequential loop's trip count as a constexpr under the interpreter (which cannot loop
    over a runtime int with numpy 2), 0 (= use the runtime argument) when compiled."""
    return n if interpret() else 0


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the dots: 3xTF32 for float32 inputs (float32 accuracy on tensor
    cores; one TF32 pass misses the 1e-4 bar, exact "ieee" dots spill 16-37 KB per thread),
    tensor cores on the 16-bit operands otherwise."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def warps(*tiles: int) -> int:
    """num_warps of a launch from its tile widths (a setting only: the results are the same)."""
    return WARPS if min(tiles) >= 64 else 4


def warp_configs(tiles: dict[str, tuple[int, ...]] | None = None, stages=(None,)) -> list:
    """``triton.Config`` s over num_warps 4 / 8, the ``tiles`` choices (name -> widths) and
    ``stages`` (None: Triton's default); pair with :func:`prune_warps`."""
    configs = [{}]
    for name, widths in (tiles or {}).items():
        configs = [dict(c, **{name: w}) for c in configs for w in widths]
    return [triton.Config(c, num_warps=w, **({} if s is None else {"num_stages": s}))
            for c in configs for w in (4, 8) for s in stages]


def prune_warps(*fixed: str, tiles: tuple[str, ...] = (), limit: dict[str, str] | None = None):
    """An ``early_config_prune`` for :func:`warp_configs`. Keeps a config only if each tile named
    in ``limit`` (tile -> the dimension it spans) is between the fixed launch's width (the padded
    dimension, at most 64) and the padded dimension, and 8 warps only where :func:`warps` allows
    8 on every tile (the ``fixed`` constexprs of the launch and the config's ``tiles``): an
    autotuning trial that faults kills the process."""
    limit = limit or {}

    def fits(width: int, dim: int) -> bool:
        padded = max(16, triton.next_power_of_2(dim))
        return min(padded, 64) <= width <= padded

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        kept = []
        for config in configs:
            widths = [args[name] for name in fixed] + [config.kwargs[name] for name in tiles]
            if not all(fits(config.kwargs[t], args[d]) for t, d in limit.items()):
                continue
            if config.num_warps > 4 and warps(*widths) == 4:
                continue
            kept.append(config)
        return kept

    return prune


def autotuned(kernel, configs: list, key: list[str], prune=None, restore: tuple[str, ...] = ()):
    """``kernel`` autotuned over ``configs`` (keyed on the ``key`` arguments and every tensor's
    dtype; ``restore``: buffers the kernel updates in place, restored between trials), or the
    plain kernel under the interpreter."""
    if interpret():
        return kernel
    name = f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}"  # e.g. conv._bwd_kernel
    TUNED[name] = compile_ahead(triton.autotune(configs, key=key, restore_value=list(restore) or None,
                                                prune_configs_by={"early_config_prune": prune} if prune else None)(kernel))
    return TUNED[name]


def default_compile_threads() -> int:
    """Threads :func:`precompile` uses when ``HYBRIDZOO_COMPILE_THREADS`` is unset: the CPUs this
    process may run on, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cpus)


def _compile_threads() -> int:
    value = os.environ.get("HYBRIDZOO_COMPILE_THREADS", "").strip()
    if not value:
        return default_compile_threads()
    if not value.isdigit():
        raise ValueError(f"HYBRIDZOO_COMPILE_THREADS must be a whole number of threads, not {value!r}")
    return int(value)


# Threads that compile an autotuner's candidates side by side before it times them (see
# :func:`precompile`); by default the process's CPUs, at most 8. 0 or 1: Triton compiles each
# candidate when it first times it, one after the other. On an H200 with 16 CPUs, ``gla-340m``'s
# cold first step took 28.7 s on 8 threads and 42.0 s without (empty Triton cache, same choices).
COMPILE_THREADS = _compile_threads()


def tuning_key(kernel, args: tuple, consts: dict) -> tuple:
    """The key under which ``kernel`` (a ``triton.runtime.Autotuner``) caches its choice for this
    launch, formed as Triton forms it: the values of its ``key`` arguments, then the dtype of
    every tensor argument, in the kernel's argument order. Where each key argument sits is worked
    out once per kernel and count of positional arguments: Triton's own lookup matches every
    argument's name against the list of names at every launch, some 15 us of host time for a
    46-argument kernel on a CPU core, paid by every launch of a small model's step."""
    plan = kernel.__dict__.get("_hybridzoo_key_plan")
    if plan is None or plan[0] != len(args):
        names = kernel.arg_names
        where = {name: i for i, name in enumerate(names)}
        keys = tuple(where[k] if where[k] < len(args) else k for k in kernel.keys if k in where)
        plan = kernel._hybridzoo_key_plan = (len(args), keys, frozenset(names[len(args):]))
    _, keys, later = plan
    key = [args[k] if isinstance(k, int) else consts[k] for k in keys if isinstance(k, int) or k in consts]
    key += [str(value.dtype) for value in args if hasattr(value, "dtype")]
    key += [str(value.dtype) for name, value in consts.items() if name in later and hasattr(value, "dtype")]
    return tuple(key)


def cached_choice(kernel, args: tuple, consts: dict):
    """The config ``kernel`` (a ``triton.runtime.Autotuner``) has cached for this launch under
    :func:`tuning_key`, or None (not tuned yet, or fewer than two candidates: Triton then keeps
    no cache)."""
    return kernel.cache.get(tuning_key(kernel, args, consts)) if len(kernel.configs) > 1 else None


def precompile(kernel, grid, args: tuple, consts: dict, threads: int | None = None) -> bool:
    """Compile every candidate of an autotuned launch on ``threads`` threads at once (default
    :data:`COMPILE_THREADS`), before the autotuner times them. Triton's autotuner compiles each
    candidate when it first runs it, one at a time; on a cold cache that is most of a first step.
    The compiler releases the GIL (MLIR passes, ``ptxas``), so candidates compile side by side.
    Uses Triton's own ``AsyncCompileMode``
    (``triton.runtime._async_compile``, Triton 3.6 to 3.9); the compiled kernels land in the
    kernel's cache, where the autotuner finds them. Does nothing when the launch's key is already
    tuned, with fewer than two candidates, or where Triton lacks that mode. Returns whether it
    compiled."""
    threads = COMPILE_THREADS if threads is None else threads
    if threads < 2 or len(kernel.configs) < 2 or tuning_key(kernel, args, consts) in kernel.cache:
        return False
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return False
    from concurrent.futures import ThreadPoolExecutor

    # A candidate that fails to compile is left to the autotuner, which skips it as it would
    # have (its timing then raises the same error). The autotuner's warmup clears the launch's
    # arguments (``nargs``) that a tuning round in progress still reads: kept.
    nargs = getattr(kernel, "nargs", None)
    with ThreadPoolExecutor(threads, thread_name_prefix="hybridzoo-compile") as pool:
        try:
            mode = AsyncCompileMode(pool, ignore_errors=True)
        except TypeError:  # a Triton whose private mode takes other arguments: compile as Triton does
            return False
        try:
            with mode:
                kernel.warmup(*args, grid=grid, **consts)
        finally:
            kernel.nargs = nargs
    return True


def compile_candidates_once(kernel, args: tuple, meta: dict, threads: int | None = None) -> bool:
    """Called as the autotuner ``kernel`` times a candidate (``Autotuner._bench``'s ``args`` and
    ``meta``: the launch's constants, ``grid`` and ``warmup``): the first time at a tuning key,
    :func:`precompile` every candidate on ``threads`` threads (default :data:`COMPILE_THREADS`);
    later candidates of that key find them compiled. Returns whether it compiled. Compiling ahead
    only saves time: where it fails, it warns and the autotuner compiles each candidate itself."""
    threads = COMPILE_THREADS if threads is None else threads
    if threads < 2 or len(kernel.configs) < 2:
        return False
    try:
        consts = {name: value for name, value in meta.items() if name not in ("grid", "warmup")}
        key = tuning_key(kernel, args, consts)
        done = kernel.__dict__.setdefault("_hybridzoo_compiled_keys", set())
        if key in done:
            return False
        done.add(key)
        return precompile(kernel, meta["grid"], args, consts, threads)
    except Exception as error:  # noqa: BLE001
        name = getattr(getattr(kernel, "base_fn", None), "__name__", repr(kernel))
        warnings.warn(f"compiling {name}'s candidates ahead failed ({error!r}); its autotuner compiles them",
                      stacklevel=2)
        return False


def compile_ahead(kernel, threads: int | None = None):
    """``kernel`` (a ``triton.runtime.Autotuner``) made to compile all its candidates for a new
    tuning key side by side before it times the first (:func:`compile_candidates_once`). The
    hook sits in its ``_bench``, which Triton calls only when it tunes a key: a launch whose
    choice is cached (in memory or, with ``TRITON_CACHE_AUTOTUNING=1``, on disk) pays nothing."""
    bench = kernel._bench

    def _bench(*args, config, **meta):
        compile_candidates_once(kernel, args, meta, threads)
        return bench(*args, config=config, **meta)

    kernel._bench = _bench
    return kernel


def run(kernel, grid, *args, fixed: dict, **consts):
    """Launch ``kernel`` (plain or :func:`autotuned`) with ``consts``; ``fixed`` holds the settings
    the autotuner picks (tile widths, ``num_warps``, ``num_stages``), used when the kernel is not
    autotuned or :data:`AUTOTUNE` is off. ``grid`` may be a function of the launch's arguments.
    Returns the settings the launch used (``fixed`` or the autotuner's choice)."""
    if isinstance(kernel, triton.runtime.Autotuner):
        if AUTOTUNE:
            config = cached_choice(kernel, args, consts)
            if config is None or config.pre_hook is not None:
                kernel[grid](*args, **consts)  # tunes (or reads the disk cache) on a new key
                config = kernel.best_config
            else:  # what the autotuner's run does with a cached choice, without re-forming its key
                kernel.best_config = config
                kernel.fn[grid](*args, **consts, **config.all_kwargs())
            return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        kernel = kernel.fn
    kernel[grid](*args, **consts, **fixed)
    return fixed


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer the kernels fully write: uninitialised, or NaN-filled when POISON_OUTPUTS is set."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def row_stride(x: torch.Tensor) -> int | None:
    """Elements from one token of ``x [B, T, ...]`` to the next, across sequences too, where a
    kernel can read its tokens as evenly spaced rows: the dims after T dense (a slice of the
    channels of a wider tensor qualifies, as Mamba's halves of ``in_proj``'s output and the B and
    C columns of ``x_proj``'s do). None where the tokens are not evenly spaced (then copy it)."""
    shape, strides = x.shape, x.stride()
    width = 1
    for k in range(len(shape) - 1, 1, -1):
        if shape[k] != 1 and strides[k] != width:
            return None
        width *= shape[k]
    batch, length = shape[0], shape[1]
    step = strides[1] if length > 1 else (strides[0] if batch > 1 else width)
    if step < width or (batch > 1 and length > 1 and strides[0] != length * step):
        return None
    return step


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where :func:`row_stride` can read it in place, else a contiguous copy."""
    return x if row_stride(x) is not None else x.contiguous()


def sum_head_groups(x: torch.Tensor, hk: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, T, H, D]`` (a gradient per value head) -> ``[B, T, hk, D]`` in ``dtype``: the sum
    over the ``H // hk`` value heads that share each q/k head. With ``H == hk`` only the cast
    runs (a sum over a size-1 axis would still launch a reduction: 0.45 ms of a 4 ms backward at
    B2 T16384 H16 D128 on an H200, scripts/profile_kernels.py)."""
    B, T, H, D = x.shape
    if H == hk:
        return x.to(dtype)
    return x.view(B, T, hk, H // hk, D).sum(3).to(dtype)
