"""The `orca-jax` command line: pull, convert, generate."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orca-jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    pull = commands.add_parser("pull", help="download and convert a preset's published weights")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--force", action="store_true", help="pull again even if already present")

    convert = commands.add_parser("convert", help="import a GGUF file or a Hugging Face safetensors folder")
    convert.add_argument("source", type=Path, help="path to a .gguf file or an HF model folder")
    convert.add_argument("--name", required=True, help="checkpoint name (directory under checkpoints/)")
    convert.add_argument("--out", type=Path, default=None, help="write here instead of checkpoints/<name>")

    generate = commands.add_parser("generate", help="generate text for prompts (args, --file, or stdin)")
    generate.add_argument("prompts", nargs="*", help="prompt texts; one per line on stdin when omitted")
    generate.add_argument("--model", default=DEFAULT_MODEL, help="preset name or checkpoint directory")
    generate.add_argument("--file", type=Path, help="read prompts from this file, one per line")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")

    args = parser.parse_args(argv)
    if args.command == "pull":
        from orca_jax.checkpoint.convert import pull as pull_model

        pull_model(args.name, force=args.force)
    elif args.command == "convert":
        from orca_jax.checkpoint.convert import convert as convert_model

        dest = convert_model(args.source, args.name, args.out)
        print(f"converted {args.source} -> {dest}")
    elif args.command == "generate":
        return _generate(args)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    text = args.file.read_text() if args.file else sys.stdin.read()
    return [line for line in text.splitlines() if line.strip()]


def _generate(args: argparse.Namespace) -> int:
    from orca_jax.checkpoint.convert import PULL_SOURCES, pull
    from orca_jax.checkpoint.store import load_model, resolve_checkpoint_dir
    from orca_jax.model.recompute import RecomputeGenerator

    if args.max_tokens < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    prompts = _read_prompts(args)
    if not prompts:
        print("error: no prompts given (pass them as arguments, with --file, or on stdin)", file=sys.stderr)
        return 2
    if args.model in PULL_SOURCES and not (resolve_checkpoint_dir(args.model) / "model.toml").is_file():
        print(f"{args.model} is not pulled yet; pulling it now", file=sys.stderr)
        pull(args.model, log=lambda m: print(m, file=sys.stderr))
    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        print(f"error: checkpoint {loaded.path} has no tokenizer.json; text prompts need one", file=sys.stderr)
        return 2
    tokenizer = loaded.tokenizer
    generator = RecomputeGenerator(loaded.model)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    total_tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
        ids = tokenizer.encode(text)
        print(f">>> {prompt}")
        generated: list[int] = []
        shown = ""
        for token in generator.greedy(ids, args.max_tokens, stop):
            generated.append(token)
            full = tokenizer.decode(generated, skip_special_tokens=True)
            print(full[len(shown):], end="", flush=True)  # print only the new text
            shown = full
        print()
        total_tokens += len(generated)
    elapsed = time.perf_counter() - start
    print(f"[{total_tokens} tokens in {elapsed:.1f} s, {total_tokens / elapsed:.2f} tok/s, greedy, full recompute]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
