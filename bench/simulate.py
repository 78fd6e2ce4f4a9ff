"""The scheduling simulation, for the bench scripts and their tests: it lives in the package
(orca_jax/tuning/simulate.py), where `orca-jax tune` uses it installed; see there."""

from orca_jax.tuning.simulate import (  # noqa: F401 (re-exported)
    POLICIES,
    SimConfig,
    SimResult,
    SimStep,
    StepTimeModel,
    ideal_ratio,
    occupancy,
    predicted_wall_s,
    simulate,
    simulate_arrivals,
)
