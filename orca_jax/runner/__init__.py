"""The device side: the only code under orca_jax/ besides model/, parallel/ and checkpoint/ that
imports jax. `model_runner` (jit, buckets, stages, KV arrays), `compile_cache` (stored programs),
`builder` (EngineConfig -> warmed-up runner and engine), `follower` (a multi-host follower's loop).
The engine reaches the device only through the Runner contract in engine/step_plan.py.
"""
