"""LLMEngine: add_request / abort / step. One step = schedule -> dispatch -> collect -> update -> outputs.

The roles: the scheduler (scheduler.py) plans each step and answers the questions of policy; the
runner executes it (the only part that touches jax); the output processor (output_processor.py)
turns sampled tokens into stop decisions and RequestOutputs. The engine holds intake (validation,
one request per sample) and the loop. Pure Python.

Batches in flight (Orca's n_workers): with a pipelined runner (`runner.max_in_flight` > 1) a step
dispatches a new iteration and returns without waiting while the pipeline has room and the
scheduler found work for it; it waits only for the oldest iteration's result, when the pipeline is
full or nothing else can be scheduled. The steps in flight have one record, `self.in_flight`
(step_state.StepsInFlight, shared with the scheduler as the KV manager is): pushed after dispatch,
the oldest popped before collect. Under a pipeline a request is in at most one iteration in flight
(the scheduler skips those the record holds). With one stage and async scheduling (scheduler.py)
two steps are in flight the same way, the newer one continuing the older one's requests on tokens
the runner feeds on the device; without it every step dispatches and collects at once.

A step's new tokens are appended to its requests here, once, one at a time (`_update`): a stop
among them (a stop token or string, or max_tokens reached) ends the request there and drops the
rest.
"""

from __future__ import annotations

import itertools
import random
import time

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.kv_manager import KVCacheManager
from orca_jax.engine.output_processor import OutputProcessor, RequestGroup, Sample
from orca_jax.engine.request import Request, RequestStatus
from orca_jax.engine.scheduler import make_scheduler
from orca_jax.engine.speculation import DraftPolicy
from orca_jax.engine.step_state import SchedulerOutput, StepsInFlight
from orca_jax.engine.step_plan import Runner, RunnerLost, StepTokens, build_step_plan
from orca_jax.engine.structured_output import GrammarCompiler, GrammarError
from orca_jax.outputs import RequestMetrics, RequestOutput
from orca_jax.sampling_params import MAX_STOP_IDS, SamplingParams
from orca_jax.tokenizer import Tokenizer


class RequestRejected(ValueError):
    """A request that can never be served under the current limits; the message names the limit.
    `code` is a machine-readable reason where clients know one (OpenAI's "context_length_exceeded")."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class StepFailed(RuntimeError):
    """The runner raised while executing a step. `request_ids` are the requests that step scheduled
    (their state is unknown now); the engine's other requests are untouched and can go on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: Runner, tokenizer: Tokenizer | None,
                 max_model_len: int | None = None):
        """`runner` executes StepPlans (the ModelRunner, or a mock in scheduler tests)."""
        self.config = config
        self.model_config = model_config
        self._eos_token_ids = model_config.eos_token_ids  # every request stops at any of them (shared, frozen)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or model_config.max_position
        self.runner = runner
        self.kv = KVCacheManager(runner.kv_layout.num_pages, config.cache.page_size, config.cache.enable_prefix_caching)
        # Speculative decoding needs a runner that proposes as many drafts (built for the same config).
        spec = config.speculative_config
        if spec is not None and spec.num_speculative_tokens != runner.kv_layout.num_speculative_tokens:
            raise ValueError(f"speculative_config asks for {spec.num_speculative_tokens} draft tokens but the runner "
                             f"was built for {runner.kv_layout.num_speculative_tokens}; build both from one config")
        self.drafts = None if spec is None else DraftPolicy(spec)
        # The one record of the steps dispatched and not yet collected (step_state.py), which also
        # decides how many there may be and whether the scheduler plans ahead (async scheduling).
        self.in_flight = StepsInFlight.for_engine(config, runner.max_in_flight, runner.feeds_sampled_tokens)
        self.scheduler = make_scheduler(config.scheduler, self.kv, self.in_flight, drafts=self.drafts,
                                        max_model_len=self.max_model_len)
        self.output_processor = OutputProcessor(tokenizer, self.max_model_len)
        self._released_by_abort: dict[str, RequestGroup] = {}  # static batches completed by an abort
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.last_step_num_tokens = 0  # tokens computed by the latest step (prompt chunks and decodes)
        self.step_time_s = 0.0  # wall time inside step(), host work and device work together
        self.grammars = None if tokenizer is None else GrammarCompiler(
            tokenizer, model_config.vocab_size, config.structured_outputs.disable_additional_properties)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, arrival_time: float | None = None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else random.getrandbits(63)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(child_id, list(prompt_token_ids), params, seed, self._eos_token_ids,
                              RequestMetrics(arrival_time=arrival))
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     params.skip_special_tokens, params.stop,
                                                     params.include_stop_str_in_output)
            if params.structured_outputs is not None:
                request.grammar = self.grammars.grammar(params.structured_outputs)
            samples.append(Sample(request, detokenizer, [] if params.logprobs is not None else None))
            self.scheduler.add(request)
        self.output_processor.add(RequestGroup(request_id, prompt, list(prompt_token_ids), samples))
        return request_id

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can ever hold: the context length, or the
        whole KV cache if that is smaller."""
        return min(self.max_model_len, self.kv.num_pages * self.kv.page_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestRejected, naming the limit, for a request that could never be served."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        not_ints = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool)]
        if not_ints:
            raise RequestRejected(f"prompt token ids must be Python ints; got {not_ints[:5]!r} "
                                  f"({type(not_ints[0]).__name__}); convert them, e.g. with .tolist()")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"context length of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
                code="context_length_exceeded")
        if total > self.max_request_tokens:  # the context fits (checked above), so the KV cache is the limit
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens exceeds the whole KV cache ({self.max_request_tokens} tokens); "
                "raise kv_cache_memory or lower max_tokens")
        longest = self.scheduler.max_prompt_tokens  # None: the policy splits prompts into chunks
        if longest is not None and len(prompt_ids) > longest:
            raise RequestRejected(
                f"the prompt ({len(prompt_ids)} tokens) exceeds max_num_batched_tokens={longest}, the most the "
                f"'{self.config.scheduler.policy}' policy computes in one step; raise max_num_batched_tokens or "
                "use the 'chunked' policy")
        if params.min_tokens > 0:  # the sampler suppresses them all until min_tokens: a row holds MAX_STOP_IDS
            suppressed = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_token_ids)
            if len(suppressed) > MAX_STOP_IDS:
                raise RequestRejected(
                    f"with min_tokens, at most {MAX_STOP_IDS} stop_token_ids and end-of-sequence ids together are "
                    f"supported; this model has {len(self._eos_token_ids)} end-of-sequence ids")
        for token in params.stop_token_ids:
            if token >= vocab:
                raise RequestRejected(f"stop token id {token} is outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise RequestRejected("stop strings need a tokenizer; this checkpoint has none")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise RequestRejected(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise RequestRejected("structured outputs need a tokenizer; this checkpoint has none")
            try:
                self.grammars.compile(params.structured_outputs)  # cached: add_request pays nothing more
            except GrammarError as error:
                raise RequestRejected(str(error)) from error

    def abort(self, request_id: str) -> bool:
        """Stops a request now and frees its pages; returns False if it is unknown or done."""
        group = self.output_processor.groups.get(request_id)
        if group is None:
            return False
        for sample in group.samples:
            if not sample.request.finished:
                self.output_processor.release(self.scheduler.finish(sample.request, RequestStatus.FINISHED_ABORTED),
                                              self._released_by_abort)
            sample.released = True
        self._released_by_abort.pop(request_id, None)
        self.output_processor.forget(group)
        return True

    def close(self) -> None:
        """Ends the runner's work beyond this process: a multi-host leader tells its followers
        that no more steps come, so they exit 0 (a runner of one process, or a mock, has nothing
        to close)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ---- the loop ------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One iteration. Returns an output for every request that got new tokens or finished
        (`finished_only`: for the finished ones only, as the offline `LLM` wants: an output copies
        the request's tokens so far, and building one for every request every step was most of
        the host's output work)."""
        start = time.perf_counter()
        try:
            return self._step(finished_only)
        finally:
            self.step_time_s += time.perf_counter() - start

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        touched, self._released_by_abort = self._released_by_abort, {}
        dispatched = False
        if self.in_flight.has_room:
            scheduled = self.scheduler.schedule()
            if not scheduled.empty:
                self._dispatch(scheduled)
                dispatched = True
        # Keep filling the pipeline while it has room and work; otherwise wait for the oldest step.
        if self.in_flight and not (dispatched and self.in_flight.has_room):
            scheduled, sampled = self._collect_oldest()
            self._update(scheduled, sampled, touched)
        return self.output_processor.outputs(touched, finished_only)

    def _dispatch(self, scheduled: SchedulerOutput) -> None:
        try:
            plan = build_step_plan(scheduled, self.runner.buckets, self.runner.kv_layout, self.model_config.vocab_size)
            pending = self.runner.dispatch(plan)
        except RunnerLost:
            raise  # not this step's fault: nothing can run any more
        except Exception as error:
            raise self._step_failed(scheduled, error) from error
        self.in_flight.push(scheduled, pending)

    def _collect_oldest(self) -> tuple[SchedulerOutput, dict[str, StepTokens]]:
        scheduled, pending = self.in_flight.pop_oldest()
        try:
            sampled = self.runner.collect(pending)
        except RunnerLost:
            raise
        except Exception as error:
            raise self._step_failed(scheduled, error) from error
        return scheduled, sampled

    def _update(self, scheduled: SchedulerOutput, sampled: dict[str, StepTokens],
                touched: dict[str, RequestGroup]) -> None:
        """Advances the step's requests, appends their tokens and finishes those that are done."""
        self.num_steps += 1
        self.last_step_num_tokens = scheduled.num_batched_tokens
        advanced = self.scheduler.update_after_step(scheduled, sampled)
        for request in advanced:
            group, sample = self.output_processor.sample(request.request_id)
            # Taken in one at a time, as if generated one per step: a stop among accepted drafts
            # ends the request there, and the tokens after it are dropped.
            tokens = sampled[request.request_id].tokens
            status = None
            for token in tokens:
                request.output_token_ids.append(token.token)
                self.num_generated_tokens += 1
                self.output_processor.record(sample, token)
                status = self.output_processor.stop_status(sample)
                if status is not None:
                    break
            # Its computed pages may be shared now: hashed only now that accepted drafts are tokens.
            self.kv.cache_full_pages(request, request.num_computed_tokens)
            if status is not None:
                self.output_processor.release(self.scheduler.finish(request, status), touched)
            if not self.scheduler.releases_whole_batches:
                touched[group.request_id] = group

    def _step_failed(self, scheduled: SchedulerOutput, error: Exception) -> StepFailed:
        """The groups of the failed step's requests that are still known (aborted ones are not)."""
        known = (self.output_processor.sample(s.request.request_id) for s in scheduled.scheduled)
        groups = dict.fromkeys(entry[0].request_id for entry in known if entry is not None)
        return StepFailed(list(groups), error)
