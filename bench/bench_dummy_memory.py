"""Peak host memory (RSS) of a dummy model loaded in one process, and at pp 2 over two processes on
loopback (each process makes only its own stage's weights). TinyLlama 1.1B in float32 on CPU: the
weights (4.4 GB) dominate; the generated ids must be the same both ways.

    python bench/bench_dummy_memory.py          # writes bench/results/dummy_memory_new.json
"""
import json, os, sys, socket
import machine
F = ("--model tinyllama-1.1b --load-format dummy --max-num-seqs 2 --max-num-batched-tokens 16 --kv-cache-memory 16MiB "
     "--max-model-len 128 --prompt-token-ids 1,450,7483 --max-tokens 4").split()
env = {**os.environ, "JAX_PLATFORMS": "cpu"}; env.pop("JAX_NUM_CPU_DEVICES", None)
base = [sys.executable, "-m", "orca_jax.cli", "generate", *F]

def run(cmds):
    runs = machine.run_with_peak_rss(cmds, env=env, interval_s=0.2)
    return [r.returncode for r in runs], [r.peak_rss_mib for r in runs], [(r.stdout, r.stderr) for r in runs]

codes, peaks, outs = run([base])
print("one process", codes, "peak RSS MiB", peaks, outs[0][0].strip().splitlines()[-1], flush=True)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
hosts = ["--pipeline-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
codes2, peaks2, outs2 = run([base + hosts + ["--process-id", "1"], base + hosts + ["--process-id", "0"]])
print("two processes (follower, leader)", codes2, "peak RSS MiB", peaks2, outs2[1][0].strip().splitlines()[-1:], flush=True)
json.dump({"machine": machine.describe(), "model": "tinyllama-1.1b dummy float32 (4.4 GB of weights)", "one_process_peak_rss_mib": peaks[0],
           "two_processes_pp2_peak_rss_mib": {"leader": peaks2[1], "follower": peaks2[0]}},
          open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dummy_memory_new.json"), "w"), indent=2)
