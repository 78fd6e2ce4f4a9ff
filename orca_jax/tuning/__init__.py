"""`orca-jax tune`: serving settings chosen for a latency target (docs: the tune command).

- workload.py: requests as lengths and arrival times (seeded distributions, JSONL files);
- simulate.py: the scheduling policies stepped on request lengths, with arrival times and a step
  cost, giving each request's time to first token and time per output token;
- cost_model.py: seconds per step as a linear function of its shape, fitted by least squares;
- measure.py: times steps of the real runner on a grid of shapes (the only module here that runs jax);
- search.py: the settings the memory plan allows, each priced by the simulation against the workload;
- loadgen.py: one real run: `orca-jax serve` started with the chosen settings, the workload replayed;
- tune.py: the command, tying these together; report.py: what it prints and keeps (tables, plot, JSON).

Nothing here imports jax at import time, so `orca_jax.cli` stays light.
"""
