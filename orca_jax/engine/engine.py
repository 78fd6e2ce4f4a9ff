"""LLMEngine: add_request / abort / step. One step = schedule -> dispatch -> collect -> postprocess -> outputs.

Pure Python: the runner is the only part that touches jax.

Batches in flight (Orca's n_workers): with a pipelined runner (`runner.max_in_flight` > 1) a step
dispatches a new iteration and returns without waiting while the pipeline has room and the
scheduler found work for it; it waits only for the oldest iteration's result, when the pipeline is
full or nothing else can be scheduled. A request is in at most one iteration in flight (the
scheduler skips `request.in_flight`). With one stage every step dispatches and collects at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections import Counter, deque
from dataclasses import dataclass

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.kv_manager import KVCacheManager
from orca_jax.engine.request import Request, RequestStatus
from orca_jax.engine.scheduler import Scheduler, SchedulerOutput
from orca_jax.engine.step_plan import Runner, RunnerLost
from orca_jax.engine.structured_output import GrammarCompiler, GrammarError
from orca_jax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
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


@dataclass
class _Sample:
    """Host-side state of one of a request's n samples."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    released: bool = False


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]

    @property
    def finished(self) -> bool:
        return all(s.released for s in self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: Runner, tokenizer: Tokenizer | None,
                 max_model_len: int | None = None):
        """`runner` executes SchedulerOutputs (the ModelRunner, or a mock in scheduler tests)."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or model_config.max_position
        self.runner = runner
        num_pages = runner.num_pages
        self.kv = KVCacheManager(num_pages, config.cache.page_size, config.cache.enable_prefix_caching)
        # With a pipeline of depth d, each step takes about 1/d of the running requests.
        per_step = -(-config.scheduler.max_num_seqs // runner.max_in_flight)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_seqs_per_step=per_step)
        self.groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Group, _Sample]] = {}  # child request id -> its group and state
        self._released_by_abort: dict[str, _Group] = {}  # static batches completed by an abort
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.last_step_num_tokens = 0  # tokens computed by the latest step (prompt chunks and decodes)
        self.step_time_s = 0.0  # wall time inside step(), host work and device work together
        self.in_flight: deque[tuple[SchedulerOutput, object]] = deque()  # dispatched, oldest first
        self.in_flight_depths: Counter[int] = Counter()  # iterations in flight right after each dispatch
        self.grammars = None if tokenizer is None else GrammarCompiler(
            tokenizer, model_config.vocab_size, config.structured_outputs.disable_additional_properties)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, arrival_time: float | None = None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else random.getrandbits(63)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(child_id, list(prompt_token_ids), params, seed, self.model_config.eos_token_id,
                              RequestMetrics(arrival_time=arrival))
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     params.skip_special_tokens, params.stop,
                                                     params.include_stop_str_in_output)
            if params.structured_outputs is not None:
                request.grammar = self.grammars.grammar(params.structured_outputs)
            samples.append(_Sample(request, detokenizer, [] if params.logprobs is not None else None))
            self.scheduler.add(request)
        group = _Group(request_id, prompt, list(prompt_token_ids), samples)
        self.groups[request_id] = group
        for sample in samples:
            self._samples[sample.request.request_id] = (group, sample)
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
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
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
        policy, budget = self.config.scheduler.policy, self.config.scheduler.max_num_batched_tokens
        if policy != "chunked" and len(prompt_ids) > budget:  # the others prefill a prompt in one step
            raise RequestRejected(
                f"the prompt ({len(prompt_ids)} tokens) exceeds max_num_batched_tokens={budget}, the most the "
                f"'{policy}' policy computes in one step; raise max_num_batched_tokens or use the 'chunked' policy")
        if params.min_tokens > 0 and len(params.stop_token_ids) + 1 > MAX_STOP_IDS:
            raise RequestRejected(f"with min_tokens, at most {MAX_STOP_IDS - 1} stop_token_ids are supported")
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
        group = self.groups.get(request_id)
        if group is None:
            return False
        for sample in group.samples:
            if not sample.request.finished:
                self._release(self.scheduler.finish(sample.request, RequestStatus.FINISHED_ABORTED),
                              self._released_by_abort)
            sample.released = True
        self._released_by_abort.pop(request_id, None)
        self._forget(group)
        return True

    def _release(self, requests: list[Request], touched: dict[str, _Group]) -> None:
        for request in requests:
            if request.request_id not in self._samples:
                continue  # aborted earlier; its static batch is only now released
            group, sample = self._samples[request.request_id]
            sample.released = True
            touched[group.request_id] = group

    def _forget(self, group: _Group) -> None:
        del self.groups[group.request_id]
        for sample in group.samples:
            del self._samples[sample.request.request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. Returns an output for every request that got new tokens or finished."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_time_s += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        touched, self._released_by_abort = self._released_by_abort, {}
        dispatched = False
        if len(self.in_flight) < self.runner.max_in_flight:
            plan: SchedulerOutput = self.scheduler.schedule()
            if not plan.empty:
                self._dispatch(plan)
                dispatched = True
        # Keep filling the pipeline while it has room and work; otherwise wait for the oldest step.
        if self.in_flight and not (dispatched and len(self.in_flight) < self.runner.max_in_flight):
            self._collect_oldest(touched)
        outputs = [self._output(g) for g in touched.values()]
        for group in touched.values():
            if group.finished:
                self._forget(group)
        return outputs

    def _dispatch(self, plan: SchedulerOutput) -> None:
        try:
            pending = self.runner.dispatch(plan)
        except RunnerLost:
            raise  # not this step's fault: nothing can run any more
        except Exception as error:
            raise self._step_failed(plan, error) from error
        for planned in plan.scheduled:
            planned.request.in_flight = True
        self.in_flight.append((plan, pending))
        self.in_flight_depths[len(self.in_flight)] += 1

    def _collect_oldest(self, touched: dict[str, _Group]) -> None:
        plan, pending = self.in_flight.popleft()
        for planned in plan.scheduled:
            planned.request.in_flight = False
        try:
            sampled = self.runner.collect(pending)
        except RunnerLost:
            raise
        except Exception as error:
            raise self._step_failed(plan, error) from error
        self.num_steps += 1
        self.last_step_num_tokens = plan.num_batched_tokens
        advanced = self.scheduler.update_after_step(plan, {rid: s.token for rid, s in sampled.items()})
        self.num_generated_tokens += len(advanced)
        for request in advanced:
            group, sample = self._samples[request.request_id]
            if request.grammar is not None:
                request.grammar.accept(request.output_token_ids[-1])
            self._record(sample, sampled[request.request_id])
            status = self._stop_status(sample)
            if status is not None:
                self._release(self.scheduler.finish(request, status), touched)
            if self.config.scheduler.policy != "static":  # static releases whole batches only
                touched[group.request_id] = group

    def _step_failed(self, plan: SchedulerOutput, error: Exception) -> StepFailed:
        """The groups of the failed step's requests that are still known (aborted ones are not)."""
        groups = dict.fromkeys(self._samples[s.request.request_id][0].request_id for s in plan.scheduled
                               if s.request.request_id in self._samples)
        return StepFailed(list(groups), error)

    def _record(self, sample: _Sample, sampled) -> None:
        request = sample.request
        sample.cumulative_logprob += sampled.logprob
        if sample.logprobs is not None:
            ids, values = sampled.top
            entry = {i: Logprob(v, rank + 1, self._token_text(i)) for rank, (i, v) in enumerate(zip(ids, values))}
            if sampled.token not in entry:
                entry[sampled.token] = Logprob(sampled.logprob, None, self._token_text(sampled.token))
            sample.logprobs.append(entry)
        if sample.detokenizer is not None:
            sample.detokenizer.add(request.output_token_ids[-1])

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _stop_status(self, sample: _Sample) -> RequestStatus | None:
        request, params = sample.request, sample.request.params
        token = request.output_token_ids[-1]
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if sample.detokenizer is not None and sample.detokenizer.stopped_by is not None:
                request.stop_reason = sample.detokenizer.stopped_by
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.finished:  # complete: only EOS could follow
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, group: _Group) -> RequestOutput:
        completions, metrics = [], []
        for i, sample in enumerate(group.samples):
            r = sample.request
            completions.append(CompletionOutput(
                index=i,
                text=sample.detokenizer.text if sample.detokenizer is not None else "",
                token_ids=list(r.output_token_ids),
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=None if sample.logprobs is None else list(sample.logprobs),
                finish_reason=r.status.value if r.finished else None,
                stop_reason=r.stop_reason,
            ))
            metrics.append(dataclasses.replace(r.metrics))  # a snapshot: the engine keeps updating its own
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             group.finished, metrics[0], metrics)
