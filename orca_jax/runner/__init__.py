"""The device side: the only code under orca_jax/ besides model/, parallel/ and checkpoint/ that
imports jax. `model_runner` (ModelRunner: jit, buckets, stages, KV arrays; dispatch and collect),
`stage` (building a pipeline stage), `programs` (compilation, warm-up, first runs), `step_inputs`
and `packing` (a step's host arrays as the programs take them), `speculation` and `draft_model`
(speculative decoding), `compile_cache` (stored programs), `builder` (EngineConfig -> warmed-up
runner and engine), `follower` (a multi-host follower's loop).
The engine reaches the device only through the Runner contract in engine/step_plan.py.
"""
