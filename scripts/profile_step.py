"""Profile one training step (forward + backward) of a recipe on CUDA: the top kernels by GPU time.

    python3 scripts/profile_step.py gated-deltanet-340m --tokens 8192 --out profile.txt
    python3 scripts/profile_step.py mamba2-130m --batch 8 --tokens 2048   # the model table's step

fp32 weights, bf16 autocast, ``--batch`` sequences (1) of ``--tokens`` tokens, random tokens, one warm-up step (compilation) then one
timed and one profiled step; prints the step time and the table of the 30 kernels that took the
most GPU time. ``--seco <chunk>``: the step is ``seco_step(model, batch, chunk)`` (SeCO, exact
chunked training) instead of one forward + backward of the whole sequence. ``--peer``: profile
instead the peer model of the recipe's pair in ``python -m benchmarks models`` (mamba_ssm's,
fla's or transformers' model of the same shape), for a side-by-side reading of the two tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridzoo import HybridLM  # noqa: E402
from hybridzoo.training.seco_engine import seco_step  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (the model table: 8 x 2048)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--seco", type=int, default=None, metavar="CHUNK",
                        help="profile seco_step with this chunk size instead of full backprop")
    parser.add_argument("--peer", action="store_true",
                        help="profile the peer model of the recipe's pair in `python -m benchmarks models`")
    args = parser.parse_args()
    if args.peer and args.seco:
        parser.error("--peer profiles full backprop; it does not take --seco")
    from benchmarks.models import PAIRS, loss_of

    kind = "hybridzoo"
    if args.peer:
        if args.recipe not in PAIRS:
            parser.error(f"--peer: {args.recipe!r} has no pair; pairs: {', '.join(PAIRS)}")
        pair = PAIRS[args.recipe]
        with torch.device("cuda"):
            model, kind = pair.peer(pair.ours(False))
        model = model.to(dtype=torch.float32)
    else:
        model = HybridLM.from_recipe(args.recipe).cuda()
    ids = torch.randint(0, 256, (args.batch, args.tokens), device="cuda")  # ids < every vocabulary

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if args.seco:
                seco_step(model, {"input_ids": ids, "labels": ids}, args.seco)
            else:
                loss_of(model, kind, ids).backward()
        model.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    how = f"seco_step chunk {args.seco}" if args.seco else "full backprop"
    tokens = args.batch * args.tokens
    name = f"{args.recipe} peer ({PAIRS[args.recipe].peer_name})" if args.peer else args.recipe
    text = (f"{name}: {args.batch} x {args.tokens} tokens, {how}, step {wall * 1e3:.1f} ms "
            f"({tokens / wall:,.0f} tokens/s)\n{table}")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
