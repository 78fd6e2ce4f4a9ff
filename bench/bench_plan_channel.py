"""Per-step cost of sending a StepPlan from the leader to a follower process (multi-host), for the
channels jax.distributed offers against the TCP socket + pickle that orca_jax used before:

- `socket-pickle`: a plain TCP connection, the plan pickled (the old channel, kept here only as
  the baseline);
- `kv-store`: the coordination service's key-value store (`key_value_set_bytes` on the leader,
  `blocking_key_value_get_bytes` on the follower), the plan encoded by parallel/plan_codec.py;
- `broadcast`: `multihost_utils.broadcast_one_to_all` of the encoded plan in a fixed-size uint8
  buffer over the device collectives (gloo on CPU).

Each step is a round trip: the leader sends a plan, the follower decodes it and acknowledges over
the same channel, so the figure includes the follower's decoding. Two processes on loopback:

    python bench/bench_plan_channel.py            # writes bench/results/plan_channel_new.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import machine

ROOT = Path(__file__).resolve().parent.parent
LENGTH = struct.Struct("!Q")
BROADCAST_CAPACITY = 1 << 20  # bytes of the fixed broadcast buffer (one compiled shape)
SEND_SECONDS: dict[str, float] = {}


def sample_plans():
    """Plans of SmolLM2's default engine shape (32 seqs, 512-token budget, 8192-token context): a
    decode step (32 tokens) and a prefill step (512 tokens) of 32 sequences holding ~1000 tokens
    each (63 pages of their 512-column block tables), without penalty arrays."""
    from orca_jax.engine.step_plan import KVLayout, padding_plan

    kv = KVLayout(num_pages=4096, page_size=16, max_pages_per_seq=512, max_num_seqs=32)
    rng = np.random.default_rng(0)
    plans = {}
    for name, tokens in (("decode", 32), ("prefill", 512)):
        plan = padding_plan(tokens, 32, kv, 49152)
        plan.token_ids[:] = rng.integers(0, 49152, tokens)
        plan.block_tables[:, :63] = rng.integers(0, 4096, (32, 63))
        plans[name] = plan
    return plans


def run_socket(is_leader: bool, port: int, plan, steps: int) -> float:
    if is_leader:
        server = socket.create_server(("127.0.0.1", port))
        conn, _ = server.accept()
    else:
        for _ in range(100):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(obj):
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        conn.sendall(LENGTH.pack(len(data)) + data)

    def receive():
        size = LENGTH.unpack(read_exactly(conn, LENGTH.size))[0]
        return pickle.loads(read_exactly(conn, size))

    start = time.perf_counter()
    for step in range(steps):
        if is_leader:
            send(plan)
            assert receive() == step
        else:
            receive()
            send(step)
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


def read_exactly(conn, size: int) -> bytes:
    chunks = []
    while size:
        chunk = conn.recv(min(size, 1 << 20))
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def run_kv_store(is_leader: bool, plan, steps: int, tag: str) -> float:
    """The round trip; the leader's own share (encoding and the set call) goes to SEND_SECONDS."""
    from jax._src import distributed

    from orca_jax.parallel.plan_codec import decode_plan, encode_plan

    client = distributed.global_state.client
    start = time.perf_counter()
    for step in range(steps):
        if is_leader:
            sent = time.perf_counter()
            client.key_value_set_bytes(f"bench/{tag}/plan/{step}", encode_plan(plan))
            SEND_SECONDS[tag] = SEND_SECONDS.get(tag, 0.0) + time.perf_counter() - sent
            client.blocking_key_value_get_bytes(f"bench/{tag}/ack/{step}", 60_000)
        else:
            key = f"bench/{tag}/plan/{step}"
            decode_plan(client.blocking_key_value_get_bytes(key, 60_000))
            client.key_value_delete(key)
            client.key_value_set_bytes(f"bench/{tag}/ack/{step}", b"")
    return time.perf_counter() - start


def run_broadcast(is_leader: bool, plan, steps: int) -> float:
    from jax.experimental import multihost_utils

    from orca_jax.parallel.plan_codec import decode_plan, encode_plan

    buffer = np.zeros(BROADCAST_CAPACITY, np.uint8)
    if is_leader:
        data = encode_plan(plan)
        buffer[:8] = np.frombuffer(LENGTH.pack(len(data)), np.uint8)
        buffer[8:8 + len(data)] = np.frombuffer(data, np.uint8)
    multihost_utils.broadcast_one_to_all(buffer)  # compiles the one shape, untimed
    start = time.perf_counter()
    for _ in range(steps):
        received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
        if not is_leader:
            size = LENGTH.unpack(received[:8].tobytes())[0]
            decode_plan(received[8:8 + size].tobytes())
    return time.perf_counter() - start


def process_main(args) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.process_id)
    from orca_jax.parallel.plan_codec import encode_plan

    is_leader = args.process_id == 0
    results = []
    for name, plan in sample_plans().items():
        size = {"pickle": len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)), "encoded": len(encode_plan(plan))}
        channels = {
            "socket-pickle": lambda: run_socket(is_leader, args.port + 1 + len(results), plan, args.steps),
            "kv-store": lambda: run_kv_store(is_leader, plan, args.steps, name),
            "broadcast": lambda: run_broadcast(is_leader, plan, args.steps),
        }
        for channel, run in channels.items():
            elapsed = run()
            send_ms = 1000 * SEND_SECONDS[name] / args.steps if channel == "kv-store" and is_leader else None
            results.append({"plan": name, "channel": channel, "bytes": size, "steps": args.steps,
                            "ms_per_step": 1000 * elapsed / args.steps, "leader_send_ms": send_ms})
            if is_leader:
                send = "" if send_ms is None else f", of which the leader's send {send_ms:.3f}"
                print(f"{name:8s} {channel:14s} {1000 * elapsed / args.steps:7.3f} ms/step round trip{send} "
                      f"(plan {size['encoded'] / 1024:.0f} KiB encoded, {size['pickle'] / 1024:.0f} KiB pickled)",
                      flush=True)
    if is_leader:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine.describe(), "processes": 2,
                                        "results": results}, indent=2))
        print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--port", type=int, default=7461)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_channel_new.json")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        process_main(args)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    common = [sys.executable, __file__, "--steps", str(args.steps), "--port", str(args.port), "--out", str(args.out)]
    follower = subprocess.Popen([*common, "--process-id", "1"], env=env, stdout=subprocess.DEVNULL)
    leader = subprocess.run([*common, "--process-id", "0"], env=env)
    follower.wait(120)
    sys.exit(leader.returncode or follower.returncode)


if __name__ == "__main__":
    main()
