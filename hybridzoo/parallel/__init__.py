"""Context parallelism: one sequence split across the ranks of a process group, exactly.

See docs/context-parallel.md. The submodules import ``torch.distributed`` only.
"""
