"""Output assembly (vLLM's output processor): sampled tokens -> stop decisions -> RequestOutputs.

The engine gives every sampled token to `record` (logprobs, cumulative logprob, grammar, incremental
text), asks `stop_status` whether the request is done, and after the step turns the groups it
touched into RequestOutputs with `outputs`. A group is a user's request: `n` samples, each its own
engine `Request`. Pure Python, no jax.
"""

from __future__ import annotations

from dataclasses import dataclass

from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.request import Request, RequestStatus
from orca_jax.engine.step_plan import SampledToken
from orca_jax.outputs import CompletionOutput, Logprob, RequestOutput
from orca_jax.tokenizer import Tokenizer


@dataclass
class Sample:
    """Host-side state of one of a request's n samples."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None  # None: not asked for (then no cumulative logprob either)
    cumulative_logprob: float = 0.0
    released: bool = False


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]

    @property
    def finished(self) -> bool:
        for sample in self.samples:  # (a loop: `all` over a generator cost twice this, every group every step)
            if not sample.released:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, tuple[RequestGroup, Sample]] = {}  # child request id -> its group and state

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for sample in group.samples:
            self._samples[sample.request.request_id] = (group, sample)

    def sample(self, request_id: str) -> tuple[RequestGroup, Sample] | None:
        """The group and sample of a child request id; None once its group is forgotten."""
        return self._samples.get(request_id)

    def release(self, requests: list[Request], touched: dict[str, RequestGroup]) -> None:
        """Marks finished requests' samples released (their final output goes out with `touched`)."""
        for request in requests:
            if request.request_id not in self._samples:
                continue  # aborted earlier; its static batch is only now released
            group, sample = self._samples[request.request_id]
            sample.released = True
            touched[group.request_id] = group

    def forget(self, group: RequestGroup) -> None:
        del self.groups[group.request_id]
        for sample in group.samples:
            del self._samples[sample.request.request_id]

    # ---- one sampled token -------------------------------------------------------------------
    def record(self, sample: Sample, sampled: SampledToken) -> None:
        """Takes in the request's newest token (already appended to its output by the scheduler)."""
        request = sample.request
        token = request.output_token_ids[-1]
        if request.grammar is not None:
            request.grammar.accept(token)
        if sample.logprobs is not None:  # (a step computes logprobs only when one of its requests asked)
            sample.cumulative_logprob += sampled.logprob
            ids, values = sampled.top
            entry = {i: Logprob(v, rank + 1, self._token_text(i)) for rank, (i, v) in enumerate(zip(ids, values))}
            if sampled.token not in entry:
                entry[sampled.token] = Logprob(sampled.logprob, None, self._token_text(sampled.token))
            sample.logprobs.append(entry)
        # The end-of-sequence token that ends a request is not part of its text, special or not (Llama
        # 3's <|eot_id|>, a GGUF's user-defined <|im_end|>), as in vLLM.
        if sample.detokenizer is not None and not self._ends_sequence(request, token):
            sample.detokenizer.add(token)

    @staticmethod
    def _ends_sequence(request: Request, token: int) -> bool:
        """Whether `token`, the request's newest, is one of the model's end-of-sequence ids and ends it."""
        params = request.params
        return (not params.ignore_eos and token in request.eos_token_ids
                and len(request.output_token_ids) >= params.min_tokens)

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def stop_status(self, sample: Sample) -> RequestStatus | None:
        """Whether the newest token ends the request, and how (None: it goes on)."""
        request, params = sample.request, sample.request.params
        token = request.output_token_ids[-1]
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if self._ends_sequence(request, token):
                return RequestStatus.FINISHED_STOPPED
            if sample.detokenizer is not None and sample.detokenizer.stopped_by is not None:
                request.stop_reason = sample.detokenizer.stopped_by
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.finished:  # complete: only EOS could follow
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- after the step ----------------------------------------------------------------------
    def outputs(self, touched: dict[str, RequestGroup], finished_only: bool = False) -> list[RequestOutput]:
        """An output for every touched group (`finished_only`: every finished one); finished groups
        are forgotten."""
        outputs = []
        for group in touched.values():
            finished = group.finished
            if finished or not finished_only:
                outputs.append(self._output(group, finished))
            if finished:
                self.forget(group)
        return outputs

    def _output(self, group: RequestGroup, finished: bool) -> RequestOutput:
        completions, metrics = [], []
        for i, sample in enumerate(group.samples):
            r = sample.request
            status = r.status
            completions.append(CompletionOutput(
                index=i,
                text=sample.detokenizer.text if sample.detokenizer is not None else "",
                token_ids=list(r.output_token_ids),
                cumulative_logprob=None if sample.logprobs is None else sample.cumulative_logprob,
                logprobs=None if sample.logprobs is None else list(sample.logprobs),
                finish_reason=status.value if status.finished else None,
                stop_reason=r.stop_reason,
            ))
            metrics.append(r.metrics.snapshot())
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             finished, metrics[0], metrics)
