"""Point-to-point communication over a process group, and the cross-rank input checks.

Every message of context parallelism goes through :func:`exchange` (one ``isend`` to a peer and
one ``irecv`` from another, posted together and then awaited, so that a ring or a shift never
deadlocks). :class:`Shift` is its autograd form: the forward moves a tensor ``offset`` ranks up
the group, the backward moves its gradient the same number of ranks down, so gradients cross
ranks exactly. The only collective is :func:`check_same_shapes` (one small ``all_gather``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist


class ContextParallelError(ValueError):
    """Bad input to a context-parallel op or model (uneven split, ranks that disagree, ...)."""


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank in group, group size)``; ``group=None`` is the default (world) group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError("context parallelism needs torch.distributed initialised "
                                   "(dist.init_process_group) before the first sharded call")
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The world rank of ``group``'s rank ``rank`` (the peer argument of send/recv)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def exchange(send: torch.Tensor | None, dst: int | None, recv_like: torch.Tensor | None,
             src: int | None, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """Send ``send`` to group rank ``dst`` and receive a tensor shaped like ``recv_like`` from
    group rank ``src`` (either side may be None: nothing sent / received). Returns the received
    tensor (a new one) or None. Both operations are posted before either is awaited."""
    works, received = [], None
    staged = _host_staged(group, send if send is not None else recv_like)
    if recv_like is not None and src is not None:
        received = torch.empty_like(recv_like, memory_format=torch.contiguous_format,
                                    device="cpu" if staged else None)
        works.append(dist.irecv(received, global_rank(group, src), group=group))
    if send is not None and dst is not None:
        wire = send.contiguous().cpu() if staged else send.contiguous()
        works.append(dist.isend(wire, global_rank(group, dst), group=group))
    for work in works:
        work.wait()
    if staged and received is not None:
        received = received.to(recv_like.device)
    return received


@contextlib.contextmanager
def count_sent() -> Iterator[list[int]]:
    """Count the bytes this process sends with ``dist.isend`` while the context is open (every
    message of :func:`exchange`): yields a one-element list, ``[bytes]``, updated as they go."""
    sent = [0]
    original = dist.isend

    def counted(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.isend = counted
    try:
        yield sent
    finally:
        dist.isend = original


def _host_staged(group, tensor: torch.Tensor | None) -> bool:
    """Device tensors over gloo (e.g. several processes sharing one GPU, which NCCL refuses) go
    through host memory."""
    return tensor is not None and tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def shift(x: torch.Tensor, offset: int, group: dist.ProcessGroup | None, *,
          cyclic: bool = False) -> torch.Tensor:
    """Rank ``p`` gets ``x`` of rank ``p - offset`` (zeros where that rank does not exist, unless
    ``cyclic``). No autograd; see :class:`Shift`."""
    rank, size = rank_and_size(group)
    dst, src = rank + offset, rank - offset
    if cyclic:
        dst, src = dst % size, src % size
    dst = dst if 0 <= dst < size and dst != rank else None
    src = src if 0 <= src < size and src != rank else None
    if cyclic and offset % size == 0:
        return x.clone()
    received = exchange(x, dst, x, src, group)
    return torch.zeros_like(x) if received is None else received


class Shift(torch.autograd.Function):
    """``y`` on rank ``p`` = ``x`` of rank ``p - offset``; the gradient goes back the other way.

    ``x`` must have the same shape and dtype on every rank. Every rank must call it (and, when
    gradients are needed, use its output) so that the backward's messages pair up.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, offset: int, group, cyclic: bool) -> torch.Tensor:
        ctx.offset, ctx.group, ctx.cyclic = offset, group, cyclic
        return shift(x, offset, group, cyclic=cyclic)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return shift(grad, -ctx.offset, ctx.group, cyclic=ctx.cyclic), None, None, None


def check_same_shapes(group: dist.ProcessGroup | None, what: str,
                      tensors: Sequence[torch.Tensor | None]) -> None:
    """Raise :class:`ContextParallelError` unless every rank passes tensors of the same shapes,
    dtypes and ``requires_grad`` flags (None included). One ``all_gather`` of 8 int64 per
    tensor dimension slot (a cheap collective; skip it with ``check=False`` in the ops)."""
    rank, size = rank_and_size(group)
    width = 8
    rows = []
    for t in tensors:
        row = [-1] * (width + 3)
        if t is not None:
            if t.dim() > width:
                raise ContextParallelError(f"{what}: tensors of more than {width} dimensions")
            row[0], row[1], row[2] = t.dim(), _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99, int(t.requires_grad)
            row[3:3 + t.dim()] = list(t.shape)
        rows.append(row)
    device = "cpu"  # gloo gathers host tensors; NCCL needs them on the inputs' device
    if dist.get_backend(group) != "gloo":
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    mine = torch.tensor(rows, dtype=torch.int64, device=device).flatten()
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    for other, theirs in enumerate(gathered):
        if not torch.equal(theirs.cpu(), mine.cpu()):
            raise ContextParallelError(
                f"{what}: ranks disagree on the inputs' shapes/dtypes/requires_grad: rank {rank} has "
                f"{_describe(mine, width)}, rank {other} has {_describe(theirs, width)}; every rank "
                f"must pass its equal-length slice of the same batch")


_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


def _describe(row: torch.Tensor, width: int) -> str:
    parts = []
    for entry in row.cpu().view(-1, width + 3).tolist():
        if entry[0] < 0:
            parts.append("None")
        else:
            parts.append(f"{tuple(entry[3:3 + entry[0]])}")
    return "[" + ", ".join(parts) + "]"


def split_evenly(length: int, parts: int, what: str) -> int:
    """``length // parts``, or :class:`ContextParallelError` if it does not divide."""
    if length % parts:
        raise ContextParallelError(
            f"{what}: a sequence of {length} tokens does not split evenly over {parts} ranks; "
            f"pad or trim it to a multiple of {parts}")
    return length // parts
