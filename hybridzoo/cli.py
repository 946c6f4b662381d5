"""The ``hybridzoo`` command line.

    hybridzoo fit --config tiny-hybrid        train (LightningCLI; also validate, test)
    hybridzoo eval runs/tiny-hybrid/export    held-out loss, perplexity, bits per byte, tokens/s
    hybridzoo eval DIR --tasks T1,T2          lm-evaluation-harness tasks (pip install 'hybridzoo[lm-eval]')
    hybridzoo generate DIR --prompt TEXT      sample a continuation
    hybridzoo recipes                         list the packaged recipes
    hybridzoo convert SRC OUT                 convert a Hugging Face / mamba_ssm checkpoint
    hybridzoo prepare SRC OUT                 tokenize a corpus once into shards (--data.prepared OUT)
    hybridzoo demo                            every reference kernel against its step loop

``fit`` / ``validate`` / ``test`` take LightningCLI arguments: ``hybridzoo fit --help``.
Every subcommand imports what it needs only when it runs.
"""

from __future__ import annotations

import argparse
import sys

from hybridzoo.cli_errors import user_error_exit, user_errors

# the LightningCLI commands (hybridzoo.training.cli) and their help lines
LIGHTNING_COMMANDS = {"fit": "train a model (LightningCLI: hybridzoo fit --help)",
                      "validate": "run the validation set (LightningCLI)",
                      "test": "run the test set (LightningCLI)"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridzoo",
                                     description="hybridzoo: hybrid recurrent language models "
                                                 "(train, evaluate, generate, convert).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:11]))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in LIGHTNING_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)

    evaluate = sub.add_parser("eval", help="evaluate an exported checkpoint directory")
    evaluate.add_argument("directory", help="a checkpoint directory (model.safetensors + config.json)")
    evaluate.add_argument("--data", action="append", metavar="PATH",
                          help="text / jsonl / parquet file or folder whose held-out split (the same "
                               "fixed split as in training) replaces the training data's (repeatable)")
    evaluate.add_argument("--max-batches", type=int, default=None,
                          help="evaluate at most this many batches (default: the whole held-out split)")
    evaluate.add_argument("--batch-size", type=int, default=None, help="override the training batch size")
    evaluate.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    harness = evaluate.add_argument_group(
        "lm-evaluation-harness", "with --tasks, run lm_eval tasks instead of the held-out loss (needs the "
        "lm-eval extra); --batch-size, --device and --json apply too")
    harness.add_argument("--tasks", metavar="T1,T2", help="lm_eval task or group names, comma-separated")
    harness.add_argument("--include-path", metavar="DIR", help="a folder of extra lm_eval task YAML files")
    harness.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per task")
    harness.add_argument("--limit", type=float, default=None,
                         help="at most this many documents per task (a fraction if < 1)")
    harness.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16", "float64"],
                         help="parameter dtype (default: as saved)")
    harness.add_argument("--output", metavar="FILE", help="write lm_eval's full results, samples included, as JSON")

    generate = sub.add_parser("generate", help="generate text from an exported checkpoint directory")
    generate.add_argument("directory", help="a checkpoint directory (model.safetensors + config.json)")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    generate.add_argument("--json", action="store_true", help="print one JSON object")

    sub.add_parser("recipes", help="list the packaged recipes")

    convert = sub.add_parser("convert", help="convert a Hugging Face / mamba_ssm checkpoint to hybridzoo")
    convert.add_argument("src", help="source checkpoint directory")
    convert.add_argument("out", help="output directory (model.safetensors + config.json)")

    from hybridzoo.training.prepare_args import add_prepare_arguments

    add_prepare_arguments(sub.add_parser("prepare", help="tokenize a corpus once, on all cores, into token "
                                                         "shards for hybridzoo fit --data.prepared OUT"))

    demo = sub.add_parser("demo", help="run every reference kernel against its step loop and print a report")
    demo.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in LIGHTNING_COMMANDS:
        from hybridzoo.training.cli import main as lightning_main

        return lightning_main(argv)
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from hybridzoo.demo import main as demo_main

        return demo_main(seq_len=args.seq_len)
    if args.command == "eval" and args.tasks is not None:
        return _eval_tasks(args)
    if args.command == "eval":
        from hybridzoo.training.evaluate import eval_command

        return eval_command(args)
    if args.command == "generate":
        from hybridzoo.training.evaluate import generate_command

        return generate_command(args)
    if args.command == "recipes":
        return _recipes()
    if args.command == "prepare":
        from hybridzoo.training.prepare import prepare_command

        return prepare_command(args)
    if args.command == "convert":
        return _convert(args.src, args.out)
    return 2  # pragma: no cover (argparse rejects unknown commands)


def _recipes() -> int:
    from rich.console import Console
    from rich.table import Table

    from hybridzoo.zoo.recipes import recipe_table

    table = Table(title="packaged recipes (hybridzoo fit --config NAME, HybridLM.from_recipe(NAME))")
    for column, justify in (("name", "left"), ("layers", "left"), ("d_model", "right"),
                            ("n_layers", "right"), ("parameters", "right")):
        table.add_column(column, justify=justify)
    for row in recipe_table():
        table.add_row(row["name"], row["layers"], str(row["d_model"]), str(row["n_layers"]),
                      f"{row['parameters']:,}")
    Console().print(table)
    return 0


def _eval_tasks(args) -> int:
    """``hybridzoo eval DIR --tasks ...``: lm-evaluation-harness (an optional package)."""
    if args.data or args.max_batches is not None:
        return user_error_exit("eval", ValueError("--data and --max-batches choose the held-out loss's data; "
                                                  "with --tasks the tasks bring their own"))
    try:
        from hybridzoo.eval_harness import tasks_command
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "lm_eval":
            raise
        return user_error_exit("eval", ImportError("--tasks runs lm-evaluation-harness, which is not installed: "
                                                   "pip install 'hybridzoo[lm-eval]' (or pip install lm-eval)"))
    return tasks_command(args)


def _convert(src: str, out: str) -> int:
    from hybridzoo.zoo.convert import convert_checkpoint

    try:
        result = convert_checkpoint(src, out)
    except user_errors(FileExistsError) as error:
        return user_error_exit("convert", error)
    print(f"converted {src} -> {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
