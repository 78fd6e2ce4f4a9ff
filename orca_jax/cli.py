"""The `orca-jax` command line: serve, generate, pull, convert, plan, tune, bench."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from orca_jax.config import DEFAULT_MODEL
from orca_jax.engine_args import add_engine_flags, config_from_flags
from orca_jax.parallel.multihost import DistributedConfig, run_process
from orca_jax.parallel.plan_cli import add_plan_arguments, plan_command
from orca_jax.paths import is_gguf_file
from orca_jax.tuning.tune import add_tune_arguments


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

    generate = commands.add_parser("generate", help="generate text for a batch of prompts (args, --file, or stdin)")
    generate.add_argument("prompts", nargs="*", help="prompt texts; one per line on stdin when omitted")
    generate.add_argument("--file", type=Path, help="read prompts from this file, one per line")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    generate.add_argument("--prompt-token-ids", action="append", type=token_ids_arg, default=[], metavar='"1 2 3"',
                          help="a prompt as token ids (repeatable), for a model without a tokenizer; the generated "
                               "ids are printed")
    add_engine_args(generate)
    add_sampling_args(generate)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="preset name, checkpoint directory or .gguf file, as `vllm serve MODEL` takes it (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on /v1/* (default: $ORCA_JAX_API_KEY, else none)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the model as given)")
    serve.add_argument("--max-queued-requests", type=int, default=256,
                       help="sequences that may wait beyond the running batch; more get a fast 503")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    serve.add_argument("--enable-request-log", action="store_true",
                       help="log one line per finished request: id, endpoint, status, token counts, latency "
                            "(never the prompt or the output)")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file replacing the model's own (as vLLM's flag)")
    serve.add_argument("--tool-call-parser", default="hermes", choices=["hermes"],
                       help="the model's tool-call format: how tools are prompted (when the chat template does "
                            "not render them), forced and parsed from the output (default: hermes, "
                            "<tool_call>{json}</tool_call>)")
    add_engine_args(serve)

    plan = commands.add_parser("plan", help="check that a model fits a tp x pp layout; per-device memory and KV pages")
    add_plan_arguments(plan)

    tune = commands.add_parser("tune", help="choose serving settings for a latency target (measured cost model, "
                                            "simulated search, one verifying run)")
    add_tune_arguments(tune)

    bench = commands.add_parser("bench", help="run a benchmark of bench/ (pass its own flags after the name)")
    bench.add_argument("name", choices=BENCHMARKS, help="scheduling (offline, every policy), serving (load "
                       "generator against servers), throughput, attention, parallel (tp x pp layouts), grammar "
                       "(structured-output engines), spec (speculative decoding off vs n-gram)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's flags; see --help after the name")

    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args.name, args.bench_args)
    if args.command == "plan":
        return plan_command(args)
    if args.command == "tune":
        from orca_jax.tuning.tune import tune_command

        return tune_command(args)
    if args.command == "serve":
        from orca_jax.checkpoint.store import CheckpointError

        try:
            _merge_model_tag(args)
            return _serve(args)
        except (CheckpointError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command in ("pull", "convert"):
        return _pull_or_convert(args)
    if args.command == "generate":
        from orca_jax.checkpoint.store import CheckpointError

        try:
            return _generate(args)
        except (CheckpointError, ValueError) as e:  # ConfigError and RequestRejected are ValueErrors
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


def _pull_or_convert(args: argparse.Namespace) -> int:
    """Import failures a user can cause (an unknown preset, no network, an unreadable or unsupported
    file) are one `error:` line and exit status 2."""
    from orca_jax.checkpoint.convert import convert, pull
    from orca_jax.checkpoint.store import CheckpointError

    try:
        if args.command == "pull":
            pull(args.name, force=args.force)
        else:
            dest = convert(args.source, args.name, args.out)
            print(f"converted {args.source} -> {dest}")
    except (CheckpointError, ValueError, OSError) as e:  # the importers' errors are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


BENCHMARKS = ["scheduling", "serving", "throughput", "attention", "parallel", "grammar", "spec"]


def _bench(name: str, bench_args: list[str]) -> int:
    """Runs bench/bench_<name>.py of the source checkout as if from the command line."""
    import runpy

    from orca_jax.paths import source_checkout

    checkout = source_checkout()
    script = checkout / "bench" / f"bench_{name}.py" if checkout else None
    if script is None or not script.is_file():
        print(f"error: no bench/bench_{name}.py here: the bench scripts ship with the source checkout, not the "
              "installed package; clone the repository and install it editable (pip install -e .)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    text = args.file.read_text() if args.file else sys.stdin.read()
    return [line for line in text.splitlines() if line.strip()]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags. Each one left out falls back to --config's file, then to EngineConfig's default."""
    group = parser.add_argument_group("engine (defaults: --config file, else configs/engine/default.toml values)")
    group.add_argument("--config", type=Path, help="an EngineConfig TOML file, e.g. configs/engine/default.toml")
    add_engine_flags(group)
    hosts = parser.add_argument_group(
        "multi-host (start one process per host with the same flags; process 0 prints or serves, the others "
        "follow it; defaults from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID)")
    hosts.add_argument("--coordinator-address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                       help="host:port of process 0: jax.distributed's coordination service, which also carries the steps")
    hosts.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    hosts.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
    hosts.add_argument("--local-device-ids", type=device_ids_arg, metavar="0,1",
                       help="this process's devices, by their number on the host, when several processes of "
                            "one job share a host (GPUs: jax makes only those visible)")
    hosts.add_argument("--step-timeout", type=float, default=60.0,
                       help="seconds the leader waits for a step from the other processes before failing")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def distributed_config(args: argparse.Namespace):
    """The multi-host settings, or None for a single process."""
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if all(v is None for v in given):
        if args.local_device_ids is not None:
            raise ValueError("--local-device-ids picks a multi-host process's devices; one process takes all it "
                             "sees: choose its GPUs with CUDA_VISIBLE_DEVICES=0,1 instead")
        return None
    if any(v is None for v in given):
        raise ValueError("multi-host needs all of --coordinator-address, --num-processes and --process-id "
                         "(or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID)")
    return DistributedConfig(args.coordinator_address, args.num_processes, args.process_id,
                             step_timeout=args.step_timeout, local_device_ids=args.local_device_ids)


def device_ids_arg(text: str) -> tuple[int, ...]:
    words = text.replace(",", " ").split()
    if not words or not all(w.isdigit() for w in words):
        raise argparse.ArgumentTypeError(f"device ids are non-negative integers separated by commas, got {text!r}")
    return tuple(int(w) for w in words)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_config(args: argparse.Namespace):
    """The EngineConfig: each flag given overrides the --config file, which overrides the defaults."""
    from orca_jax.config import EngineConfig, load_toml

    return config_from_flags(load_toml(EngineConfig, args.config) if args.config else EngineConfig(), args)


def token_ids_arg(text: str) -> list[int]:
    """`--prompt-token-ids "1 2 3"` (commas work too)."""
    words = text.replace(",", " ").split()
    if not words or not all(w.isdigit() for w in words):
        raise argparse.ArgumentTypeError(f"token ids are non-negative integers separated by spaces, got {text!r}")
    return [int(w) for w in words]


def _generate(args: argparse.Namespace) -> int:
    from orca_jax import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config, dist = engine_config(args), distributed_config(args)
    if dist is not None and not dist.is_leader:
        return run_process(dist, lambda: _follow_leader(config, dist))
    if args.prompt_token_ids and (args.prompts or args.file or args.chat):
        print("error: give prompts either as text (arguments, --file, --chat) or as --prompt-token-ids, not both",
              file=sys.stderr)
        return 2
    prompts = [{"prompt_token_ids": ids} for ids in args.prompt_token_ids] or _read_prompts(args)
    if not prompts:
        print("error: no prompts given (pass them as arguments, with --file, or on stdin)", file=sys.stderr)
        return 2
    if dist is not None:
        return run_process(dist, lambda: _print_outputs(args, prompts, params, LLM(config=config, distributed=dist)))
    return _print_outputs(args, prompts, params, LLM(config=config))


def _print_outputs(args: argparse.Namespace, prompts: list[str], params, llm) -> int:
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    llm.close()  # on several processes: tells the followers there are no more steps
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        if isinstance(prompt, dict):  # given as token ids: answered in token ids
            print(f">>> {' '.join(map(str, prompt['prompt_token_ids']))}\n"
                  f"{' '.join(map(str, output.outputs[0].token_ids))}")
        else:
            print(f">>> {prompt}\n{output.outputs[0].text.strip()}")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{len(outputs)} requests, {total} tokens in {elapsed:.1f} s: {total / elapsed:.1f} tok/s; "
          f"policy {llm.config.scheduler.policy}, compilations after warm-up: {llm.num_compilations_after_warmup}]",
          file=sys.stderr)
    return 0


def _merge_model_tag(args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` are the same; both, naming different models, is an error."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"the model is given twice, as '{args.model_tag}' and as --model '{args.model}'; "
                         "give one of them")
    args.model = args.model_tag


def _read_chat_template(path: str) -> str:
    """The --chat-template file, checked as Jinja before anything loads (a ValueError: one error line)."""
    from orca_jax.tokenizer import check_chat_template

    try:
        source = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"--chat-template: cannot read {path}: {error.strerror}") from error
    try:
        check_chat_template(source)
    except ValueError as error:
        raise ValueError(f"--chat-template {path}: {error}") from error
    return source


def _follow_leader(config, dist: DistributedConfig) -> int:
    from orca_jax.runner.follower import follow_leader  # imports jax: only a follower process needs it

    return follow_leader(config, dist)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from orca_jax.server.state import API_KEY_ENV, ServerSettings
    from orca_jax.server.serve import serve

    # Our own progress at INFO; the libraries' (absl, orbax) chatter only from WARNING up.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    logging.getLogger("orca_jax").setLevel(logging.INFO)
    chat_template = _read_chat_template(args.chat_template) if args.chat_template is not None else None
    config, dist = engine_config(args), distributed_config(args)
    # A missing checkpoint fails here, before the port opens, with the command that makes it. Several
    # processes do not pull (they would race on one folder): the checkpoint must be there.
    from orca_jax.checkpoint.store import (CheckpointError, is_complete, missing_checkpoint_message,
                                           resolve_checkpoint_dir)

    if config.load_format != "dummy":  # dummy weights need no checkpoint
        if dist is None:
            from orca_jax.checkpoint.convert import ensure_pulled

            ensure_pulled(config.model, log=lambda message: print(message, file=sys.stderr))
        if is_gguf_file(config.model):  # a file path, relative to the working directory (as LLM takes it)
            if not Path(config.model).expanduser().is_file():
                raise CheckpointError(f"{Path(config.model).expanduser().resolve()}: no such GGUF file; give the path "
                                      "of a .gguf file, a checkpoint directory or a preset name")
        elif not is_complete(resolve_checkpoint_dir(config.model)):
            raise CheckpointError(missing_checkpoint_message(config.model, resolve_checkpoint_dir(config.model)))
    if dist is not None and not dist.is_leader:
        return run_process(dist, lambda: _follow_leader(config, dist))
    settings = ServerSettings(
        model_name=args.served_model_name or config.model,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queued_requests=args.max_queued_requests, max_request_bytes=args.max_request_bytes,
        enable_request_log=args.enable_request_log, chat_template=chat_template,
        tool_call_parser=args.tool_call_parser)

    built = []  # the LLM, once the server's warm-up thread has made it

    def build_engine():
        from orca_jax import LLM
        from orca_jax.engine.async_engine import AsyncLLMEngine
        from orca_jax.runner.builder import freeze_start_up_objects

        built.append(LLM(config=config, distributed=dist))
        freeze_start_up_objects()  # this process is the server's: its whole heap is start-up's
        return AsyncLLMEngine(built[0].engine)

    def run() -> int:
        code = asyncio.run(serve(settings, build_engine, args.host, args.port, shutdown_timeout=args.shutdown_timeout))
        if code == 0 and built:
            built[0].close()  # on several processes: tells the followers to exit 0 too
        return code

    return run() if dist is None else run_process(dist, run)


if __name__ == "__main__":
    sys.exit(main())
