"""orca_jax: iteration-level scheduling and selective batching for LLM inference in JAX."""

from orca_jax.outputs import CompletionOutput, Logprob, RequestOutput
from orca_jax.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name):
    # LLM pulls in jax; import it lazily so `from orca_jax import SamplingParams` stays light.
    if name == "LLM":
        from orca_jax.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
