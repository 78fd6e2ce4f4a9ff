"""Runs every example of README.md and docs/*.md that is marked runnable; any failure fails `make docs`.

A mark is an HTML comment on the line before a fenced ```python or ```bash block:

    <!-- runnable -->           run as written, from the repository root
    <!-- runnable: server -->   run while an `orca-jax serve` runs: the example's 127.0.0.1:8000 or
                                localhost:8000 is replaced by that server's free port

The committed tiny model stands in for the default one, so the examples run as users read them (the
same model name, the same flags) in seconds: a copy of checkpoints/tiny, given an unknown-word token
and a chat template, is the checkpoint named smollm2-135m-instruct under a temporary
$ORCA_JAX_CHECKPOINTS. Its outputs are numbers, not English; an example passes when it exits 0. In
bash examples `curl` fails on an HTTP error status (--fail-with-body), so a request the server
refuses fails its example.

    python docs/run_examples.py [FILE.md ...]      # default: README.md and docs/*.md
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- runnable(?:: (?P<kind>server))? -->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w+)\s*$")
STAND_IN = "smollm2-135m-instruct"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<s> {% endif %}")
TIMEOUT_S = 300


@dataclass
class Example:
    path: Path
    line: int  # of the opening fence
    lang: str
    server: bool
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples(path: Path) -> list[Example]:
    """The marked blocks of one file; a mark inside a fenced block (a page showing the syntax) is text."""
    found, lines, fence = [], path.read_text().splitlines(), None
    for i, line in enumerate(lines):
        ticks = re.match(r"^(`{3,})", line)
        if fence is not None:
            fence = None if ticks and ticks.group(1) == fence and not line[len(fence):].strip() else fence
            continue
        if ticks:
            fence = ticks.group(1)
            continue
        mark = MARK.match(line)
        if not mark:
            continue
        block = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if block is None or block["lang"] not in ("python", "bash"):
            raise SystemExit(f"{path}:{i + 1}: a runnable mark must be followed by a ```python or ```bash block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        found.append(Example(path, i + 2, block["lang"], mark["kind"] == "server", "\n".join(lines[i + 2:end]) + "\n"))
    return found


def stand_in_checkpoints(tmp: Path) -> Path:
    """checkpoints/tiny copied as the default model's name, with an unknown-word token and a chat
    template, which the tiny model lacks."""
    root = tmp / "checkpoints"
    model = root / STAND_IN
    shutil.copytree(ROOT / "checkpoints" / "tiny", model)
    # The counting vocabulary has no unknown token: words it lacks read as "0", so English prompts encode.
    tokenizer_path = model / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    tokenizer["model"]["unk_token"] = "0"
    tokenizer_path.write_text(json.dumps(tokenizer))
    config_path = model / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2))
    return root


def environment(checkpoints: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["ORCA_JAX_CHECKPOINTS"] = str(checkpoints)
    # The compiled programs of earlier runs make a run seconds long: keep the checkout's cache.
    env.setdefault("ORCA_JAX_COMPILATION_CACHE", str(ROOT / ".jax_cache"))
    env.pop("ORCA_JAX_API_KEY", None)
    return env


def check_stand_in(env: dict[str, str], checkpoints: Path) -> None:
    """The examples must meet the tiny stand-in, never the real model (minutes instead of seconds)."""
    probe = ("from orca_jax.checkpoint.store import resolve_checkpoint_dir; "
             f"print(resolve_checkpoint_dir({STAND_IN!r}))")
    found = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    if Path(found).resolve() != (checkpoints / STAND_IN).resolve():
        raise SystemExit(f"{STAND_IN!r} resolves to {found}, not the stand-in under $ORCA_JAX_CHECKPOINTS: "
                         "update environment() in docs/run_examples.py to where checkpoints are looked up now")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    # The default engine settings, as most offline examples use: their compiled programs are shared.
    command = ["orca-jax", "serve", "--port", str(port)]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the examples' server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process, port
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the examples' server was not ready in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def run(example: Example, env: dict[str, str], port: int | None) -> subprocess.CompletedProcess:
    code = example.code
    if port is not None:
        code = re.sub(r"(127\.0\.0\.1|localhost):8000\b", f"127.0.0.1:{port}", code)
    if example.lang == "python":
        command = [sys.executable, "-c", code]
    else:
        # curl fails on an HTTP error status, unless the example asks for -f itself (the two conflict).
        wrapper = ('curl() { local a; for a in "$@"; do case "$a" in --fail|--fail-with-body|-[!-]*f*) '
                   'command curl "$@"; return;; esac; done; command curl --fail-with-body --show-error "$@"; }\n')
        command = ["bash", "-euo", "pipefail", "-c", wrapper + code]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def report(example: Example, result: subprocess.CompletedProcess | None, seconds: float) -> bool:
    ok = result is not None and result.returncode == 0
    print(f"{'ok  ' if ok else 'FAIL'} {example.where} ({example.lang}{', server' if example.server else ''}, "
          f"{seconds:.1f} s)", flush=True)
    if not ok:
        output = f"timed out after {TIMEOUT_S} s" if result is None else result.stdout + result.stderr
        print("    " + output[-3000:].replace("\n", "\n    "), flush=True)
    return ok


def timed(example: Example, env: dict[str, str], port: int | None) -> tuple[subprocess.CompletedProcess | None, float]:
    start = time.monotonic()
    try:
        return run(example, env, port), time.monotonic() - start
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start


def main(argv: list[str]) -> int:
    paths = [Path(p).resolve() for p in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    todo = [example for path in paths for example in examples(path)]
    alone = [e for e in todo if not e.server]
    with_server = [e for e in todo if e.server]
    passed = 0
    with tempfile.TemporaryDirectory(prefix="orca-jax-examples-") as tmp:
        checkpoints = stand_in_checkpoints(Path(tmp))
        env = environment(checkpoints)
        check_stand_in(env, checkpoints)
        # The first one alone: it compiles the default engine's programs into the cache, where the
        # others (most use the defaults) find them. Then two at a time: much of an example's time is
        # one thread importing jax and loading the model.
        if alone:
            passed += report(alone[0], *timed(alone[0], env, None))
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {pool.submit(timed, example, env, None): example for example in alone[1:]}
            for future in concurrent.futures.as_completed(futures):
                passed += report(futures[future], *future.result())
        if with_server:
            server, port = start_server(env, Path(tmp) / "server.log")
            try:
                for example in with_server:
                    passed += report(example, *timed(example, env, port))
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(60)
    print(f"{passed} of {len(todo)} runnable examples passed")
    return 0 if passed == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
