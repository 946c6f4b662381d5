"""Context parallelism: one sequence split across the ranks of a process group, exactly.

* :mod:`~hybridzoo.parallel.context` — ``context_parallel(group)``, the model-level switch the
  mixers consult, and ``shard_sequence``;
* :mod:`~hybridzoo.parallel.recurrent_ops` — the sharded recurrent kernel ops (state passing);
* :mod:`~hybridzoo.parallel.rank_scan` — the exclusive scan of affine maps over ranks and its
  reverse scan (sequential or log2 P rounds);
* :mod:`~hybridzoo.parallel.ring_attention` — ring attention, contiguous or zig-zag;
* :mod:`~hybridzoo.parallel.comm` — point-to-point messages as autograd Functions, shape checks;
* :mod:`~hybridzoo.parallel.costs` — bytes sent per layer and step;
* :mod:`~hybridzoo.parallel.lightning` — the Lightning callback (imports Lightning).

SeCO with each rank chunking its own slice (the rank hand-off) is
:mod:`hybridzoo.training.seco_ranks`: it needs the layers' state types, and nothing here imports
the layers (the layers import :mod:`~hybridzoo.parallel.context`).

See docs/context-parallel.md. Importing this package imports nothing but torch.
"""
