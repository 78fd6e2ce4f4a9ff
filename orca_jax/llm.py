"""The offline API, shaped like vLLM's so users can switch:

    from orca_jax import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", scheduling_policy="chunked")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path
from typing import Sequence, Union

from orca_jax.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                             from_dict)
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams

PromptType = Union[str, dict]


class LLM:
    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        scheduling_policy: str = "chunked",
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        async_scheduling: bool = True,
        page_size: int = 16,
        kv_cache_memory: int | None = None,
        device_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = False,
        kv_cache_dtype: str = "auto",
        attention_impl: str = "auto",
        max_model_len: int | None = None,
        dtype: str = "auto",
        matmul_precision: str = "auto",
        matmul_impl: str = "auto",
        quantization: str = "none",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        speculative_config: dict | SpeculativeConfig | None = None,
        load_format: str = "auto",
        dummy_seed: int = 0,
        tokenizer: str | None = None,
        token_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
        show_progress: bool = True,
        config: EngineConfig | None = None,
        distributed=None,
    ):
        """`model`: a preset name (pulled on first use if it has published weights) or a checkpoint
        directory. `kv_cache_memory`: bytes of KV cache per device (default: sized from
        `device_memory_utilization` x each accelerator's memory; 1 GiB on CPU). `load_format="dummy"`: seeded random
        weights (`dummy_seed`) of the model's shapes, for trying a layout without its weights; `tokenizer`:
        another checkpoint's tokenizer (name or directory). `token_buckets` / `seq_buckets`
        override the compiled step shapes (default: powers of two up to the limits). `config`: a whole
        EngineConfig (e.g. from a TOML file), used instead of the engine keyword arguments.
        `async_scheduling`: plan and dispatch each step while the one before computes (vLLM's flag;
        with one pipeline stage and no draft model; the outputs are the same either way).
        `speculative_config`: vLLM's dict (or a SpeculativeConfig), e.g. {"method": "ngram",
        "num_speculative_tokens": 4}; None: no speculative decoding.
        `distributed`: a multihost.DistributedConfig when this process leads others (after
        `multihost.initialize`); the followers run `orca_jax.runner.follower.follow`."""
        from orca_jax.runner.builder import BuildOptions, build_engine

        if config is not None:
            engine_args = dict(model=model, scheduling_policy=scheduling_policy, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
                               page_size=page_size,
                               kv_cache_memory=kv_cache_memory, device_memory_utilization=device_memory_utilization,
                               enable_prefix_caching=enable_prefix_caching,
                               kv_cache_dtype=kv_cache_dtype, attention_impl=attention_impl,
                               max_model_len=max_model_len, dtype=dtype, matmul_precision=matmul_precision,
                               matmul_impl=matmul_impl, quantization=quantization,
                               tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                               speculative_config=speculative_config, load_format=load_format, dummy_seed=dummy_seed,
                               tokenizer=tokenizer)
            defaults = inspect.signature(LLM.__init__).parameters
            given = sorted(name for name, value in engine_args.items() if value != defaults[name].default)
            if given:
                raise ValueError(f"LLM(config=...) takes the engine settings from the config; {given} would be "
                                 "ignored: set them in the EngineConfig instead")
        self.config = config or EngineConfig(
            model=str(model),
            max_model_len=max_model_len,
            dtype=dtype,
            matmul_precision=matmul_precision,
            matmul_impl=matmul_impl,
            quantization=quantization,
            attention_impl=attention_impl,
            load_format=load_format,
            dummy_seed=dummy_seed,
            tokenizer=tokenizer,
            cache=CacheConfig(page_size=page_size, kv_cache_memory=kv_cache_memory,
                              device_memory_utilization=device_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(policy=scheduling_policy, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      async_scheduling=async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=pipeline_parallel_size),
            speculative_config=(from_dict(SpeculativeConfig, speculative_config, "speculative_config")
                                if isinstance(speculative_config, dict) else speculative_config),
        )
        options = BuildOptions(token_buckets=token_buckets, seq_buckets=seq_buckets, show_progress=show_progress)
        self.engine = build_engine(self.config, options, distributed=distributed)
        self.runner = self.engine.runner
        self._run_first_runs(show_progress)
        self.tokenizer = self.engine.tokenizer
        self.show_progress = show_progress

    def _run_first_runs(self, show_progress: bool) -> None:
        """Every program's slow first run, here rather than inside the first jobs that need them, so
        that `generate` is steady from its first call: a server's engine thread does this while idle
        (ModelRunner.run_first_runs), but an offline job starts the moment it is given, and timing
        one (say, to compare policies) would otherwise time these runs."""
        start = time.perf_counter()
        self.runner.run_first_runs()
        if show_progress:
            print(f"first runs of the programs warm-up left: {time.perf_counter() - start:.1f} s", file=sys.stderr)

    def close(self) -> None:
        """Done with this LLM: on several processes, the followers are told to exit."""
        self.engine.close()

    @property
    def num_compilations_after_warmup(self) -> int:
        return self.runner.num_compilations_after_warmup

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt (a string or {"prompt_token_ids": [...]}) and returns the
        outputs in input order. All requests are queued at once; the engine batches them."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one, or one per prompt")
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        for (_, token_ids), p in zip(tokenized, params):  # reject the batch before queueing any of it
            self.engine.validate(token_ids, p)
        ids = [self.engine.add_request(token_ids, p, prompt=text) for (text, token_ids), p in zip(tokenized, params)]
        return self._run_to_completion(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the chat template."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(texts, sampling_params, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"a dict prompt needs 'prompt_token_ids', got keys {sorted(prompt)}")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass {'prompt_token_ids': [...]} prompts")
        return prompt, self.tokenizer.encode(prompt)

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm, unit="req")
        start, tokens_before = time.perf_counter(), self.engine.num_generated_tokens
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix(tok_s=f"{(self.engine.num_generated_tokens - tokens_before) / elapsed:.1f}")
        bar.close()
        return [finished[i] for i in request_ids]
