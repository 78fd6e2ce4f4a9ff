"""The offline API, shaped like vLLM's so users can switch:

    from orca_jax import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", scheduling_policy="chunked")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence, Union

from orca_jax.config import DEFAULT_MODEL, EngineConfig
from orca_jax.engine_args import check_keywords, config_from_keywords, llm_signature
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams

PromptType = Union[str, dict]


class LLM:
    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        token_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
        show_progress: bool = True,
        config: EngineConfig | None = None,
        distributed=None,
        **engine_args,
    ):
        """`model`: a preset name (pulled on first use if it has published weights), a checkpoint
        directory or a .gguf file (served as it is). `engine_args`: any engine setting by its keyword, e.g. `scheduling_policy="orca"`,
        `max_num_seqs=8`, `kv_cache_memory` (bytes of KV cache per device), `speculative_config` (vLLM's
        dict or a SpeculativeConfig, e.g. {"method": "ngram", "num_speculative_tokens": 4}); every one,
        with its default, is in docs/configuration.md and in inspect.signature(LLM). An unknown keyword
        is a TypeError naming its close matches. `config`: a whole EngineConfig (e.g. from a TOML
        file), used instead of the engine keywords. `token_buckets` / `seq_buckets` override the
        compiled step shapes (default: powers of two up to the limits). `distributed`: a
        multihost.DistributedConfig when this process leads others (after `multihost.initialize`); the
        followers run `orca_jax.runner.follower.follow`."""
        from orca_jax.runner.builder import BuildOptions, build_engine

        check_keywords(engine_args, others=("token_buckets", "seq_buckets", "show_progress", "config", "distributed"))
        if config is not None:
            given = sorted([*engine_args, *(["model"] if str(model) != DEFAULT_MODEL else [])])
            if given:
                raise ValueError(f"LLM(config=...) takes the engine settings from the config; {given} would be "
                                 "ignored: set them in the EngineConfig instead")
        self.config = config or config_from_keywords(model=model, **engine_args)
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
            for output in self.engine.step(finished_only=True):
                finished[output.request_id] = output
                bar.update(1)
                elapsed = time.perf_counter() - start
                bar.set_postfix(tok_s=f"{(self.engine.num_generated_tokens - tokens_before) / elapsed:.1f}")
        bar.close()
        return [finished[i] for i in request_ids]


# The engine keywords are declared once, with their fields (config.setting); the signature shows them
# to help(), inspect and notebooks as if written out.
LLM.__init__.__signature__ = llm_signature(LLM.__init__)
