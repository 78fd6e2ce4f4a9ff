"""The OpenAI-compatible endpoints. No jax.

Each handler: parse the body into a typed request (protocol.py), tokenize and validate against the
engine's limits (so a bad request is a 400 before any stream starts), hold places in the bounded
queue, then stream or collect the engine's outputs into OpenAI bodies (responses.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import time
from typing import AsyncIterator

from aiohttp import web

from orca_jax.engine.async_engine import AsyncLLMEngine, EngineStepError
from orca_jax.engine.engine import RequestRejected
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams, StructuredOutputsParams
from orca_jax.server import responses, tool_calls
from orca_jax.server.state import STATE, RequestRecord, ServerState, request_record
from orca_jax.server.protocol import (APIError, invalid, parse_chat, parse_completion, parse_detokenize,
                                      parse_tokenize)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json(request: web.Request) -> object:
    """The body as JSON: 413 past the size limit, 400 for non-UTF-8 or malformed JSON."""
    raw = await request.read()  # aiohttp raises 413 past client_max_size
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise invalid(f"the request body is not valid UTF-8 (byte {error.start}); send JSON in UTF-8") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise invalid(f"the request body is not valid JSON: {error}") from error


# ---- plain endpoints ---------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "shutting down"}, status=503)
    if state.engine is None:
        return web.json_response({"status": "warming up"}, status=503,
                                 headers={"Retry-After": str(state.settings.retry_after_s)})
    return web.json_response({"status": "ok", "first_runs_left": state.engine.first_runs_left})


async def metrics(request: web.Request) -> web.Response:
    from orca_jax.server.metrics import CONTENT_TYPE

    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("orca-jax")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never pip-installed
        number = "unknown"
    return web.json_response({"version": number})


def _model_card(state: ServerState) -> dict:
    card = {"id": state.settings.model_name, "object": "model", "created": 0, "owned_by": "orca_jax"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_model(state, request.match_info["model"])
    return web.json_response(_model_card(state))


def _check_model(state: ServerState, model: str | None) -> str:
    name = state.settings.model_name
    if model is not None and model != name:
        raise APIError(404, f"the model '{model}' does not exist on this server; it serves '{name}' "
                            "(GET /v1/models)", type="not_found_error", param="model", code="model_not_found")
    return name


# ---- generation ----------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    req = parse_completion(await read_json(request))
    engine = state.require_engine()
    model = _check_model(state, req.model)
    prompts = [_tokenize(engine, p) for p in req.prompts]
    for _, ids in prompts:
        await _validate(engine, ids, req.params)
    n = req.params.n
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    record = request_record()
    record.prompt_tokens = prompt_tokens
    with state.admitted(len(prompts) * n):
        state.metrics.prompt_tokens.inc(prompt_tokens)
        outputs = _generate_all(state, engine, prompts, req.params, arrival, record)
        async with contextlib.aclosing(outputs):
            response_id = record.request_id = responses.new_id("cmpl")
            echo = [(text if text is not None else _decode(engine, ids)) if req.echo else "" for text, ids in prompts]
            if req.stream:
                chunks = _completion_chunks(outputs, req, response_id, model, echo, prompt_tokens)
                return await _send_events(request, chunks)
            finals = await _collect(outputs, len(prompts))
    choices, completion_tokens = [], 0
    for i, final in enumerate(finals):
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = None
            if c.logprobs is not None:
                logprobs = responses.completion_logprobs(c.token_ids, c.logprobs, len(echo[i]))
            choices.append({"index": i * n + c.index, "text": echo[i] + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    body = responses.envelope(response_id, "text_completion", model, choices,
                              responses.usage(prompt_tokens, completion_tokens))
    return web.json_response(body)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    req = parse_chat(await read_json(request))
    engine = state.require_engine()
    model = _check_model(state, req.model)
    params, parser = _tool_settings(state, engine, req)
    forced = req.tools is not None and req.tool_choice not in ("none", "auto")
    _, ids = _tokenize(engine, _render_chat(state, engine, req.messages, tools=req.tools,
                                            kwargs=req.chat_template_kwargs))
    if not req.max_tokens_given:  # OpenAI's default: whatever room the context leaves
        room = engine.max_request_tokens - len(ids)
        params = params.clone(max_tokens=max(room, 1, params.min_tokens))
    await _validate(engine, ids, params)
    record = request_record()
    record.prompt_tokens = len(ids)
    with state.admitted(params.n):
        state.metrics.prompt_tokens.inc(len(ids))
        outputs = _generate_all(state, engine, [(None, ids)], params, arrival, record)
        async with contextlib.aclosing(outputs):
            response_id = record.request_id = responses.new_id("chatcmpl")
            if req.stream:
                chunks = _chat_chunks(outputs, req, params, parser, forced, response_id, model, len(ids))
                return await _send_events(request, chunks)
            (final,) = await _collect(outputs, 1)
    choices = []
    for c in final.outputs:
        logprobs = None if c.logprobs is None else responses.chat_logprobs(c.token_ids, c.logprobs)
        message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if parser is not None:
            content, calls = tool_calls.parse_text(c.text, parser, forced)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = responses.tool_finish_reason(finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    body = responses.envelope(response_id, "chat.completion", model, choices,
                              responses.usage(len(ids), completion_tokens))
    return web.json_response(body)


# ---- tokenizer endpoints (vLLM's) ----------------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    """A prompt or chat messages to token ids, exactly as the generation endpoints would tokenize them
    unless `add_special_tokens` says otherwise."""
    state = request.app[STATE]
    req = parse_tokenize(await read_json(request))
    engine = state.require_engine()
    _check_model(state, req.model)
    if req.messages is not None:
        text = _render_chat(state, engine, req.messages, req.add_generation_prompt, req.tools,
                            req.chat_template_kwargs)
    else:
        text = req.prompt
    _, ids = _tokenize(engine, text, add_bos=req.add_special_tokens)
    request_record().prompt_tokens = len(ids)
    return web.json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_detokenize(await read_json(request))
    engine = state.require_engine()
    _check_model(state, req.model)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise invalid("this model has no tokenizer, so token ids cannot be turned into text")
    vocab = tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise invalid(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
    request_record().prompt_tokens = len(req.tokens)
    return web.json_response({"prompt": tokenizer.decode(req.tokens)})


def _tool_settings(state: ServerState, engine: AsyncLLMEngine, req) -> tuple[SamplingParams, str | None]:
    """The request's sampling parameters with the grammar that forces a tool call (tool_choice
    "required" or a named function), and the parser that finds calls in the output (None: no tools)."""
    params = req.params
    if req.tools is None or req.tool_choice == "none":
        return params, None
    if req.tool_choice != "auto":
        if params.structured_outputs is not None:
            raise invalid("an output constraint (response_format, structured_outputs, guided_*) cannot be combined "
                          f"with tool_choice {req.tool_choice!r}, which constrains the output to a tool call",
                          "tool_choice")
        strict = req.disable_additional_properties
        if strict is None:
            strict = engine.structured_outputs.disable_additional_properties
        grammar = tool_calls.forced_grammar(req.tools, req.tool_choice, req.parallel_tool_calls, strict)
        params = params.clone(structured_outputs=StructuredOutputsParams(grammar=grammar))
    return params, state.settings.tool_call_parser


def _render_chat(state: ServerState, engine: AsyncLLMEngine, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise invalid("this model has no tokenizer, so no chat template; use /v1/completions with token ids")
    template = state.settings.chat_template or tokenizer.effective_chat_template
    native = tool_calls.template_renders_tools(template)
    messages = tool_calls.messages_for_template(messages, tools, native)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools if native else None, template=template, **(kwargs or {}))
    except Exception as error:  # noqa: BLE001 - templates raise their own errors (e.g. on role order)
        raise invalid(f"the model's chat template cannot render these messages: {error}", "messages") from error


def _tokenize(engine: AsyncLLMEngine, prompt: str | list[int],
              add_bos: bool | None = None) -> tuple[str | None, list[int]]:
    """(text, ids); `add_bos` None follows the tokenizer's own rule, as generation does."""
    if isinstance(prompt, list):
        return None, prompt
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise invalid("this model has no tokenizer; send the prompt as a list of token ids", "prompt")
    try:
        return prompt, tokenizer.encode(prompt, add_bos=add_bos)
    except ValueError as error:  # names the prompt and what the tokenizer lacks (Tokenizer.encode)
        raise invalid(str(error), "prompt") from error


def _decode(engine: AsyncLLMEngine, ids: list[int]) -> str:
    tokenizer = engine.tokenizer
    return "" if tokenizer is None else tokenizer.decode(ids)


async def _validate(engine: AsyncLLMEngine, ids: list[int], params: SamplingParams) -> None:
    """The engine's limits (a 400 naming the limit). A constraint is compiled here, on a worker thread
    (milliseconds, more for the first one), so a bad schema is refused before anything streams."""
    try:
        if params.structured_outputs is not None:
            await asyncio.to_thread(engine.validate, ids, params)
        else:
            engine.validate(ids, params)
    except RequestRejected as error:  # the message names the limit
        raise APIError(400, str(error), code=error.code) from error


async def _generate_all(state: ServerState, engine: AsyncLLMEngine, prompts: list[tuple[str | None, list[int]]],
                        params: SamplingParams, arrival: float,
                        record: RequestRecord) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs every prompt at once and yields (prompt index, output) as they come, keeping the
    record's completion token count current. Closing this generator (the client left) cancels the
    per-prompt tasks, which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, text: str | None, ids: list[int]) -> None:
        try:
            async for output in engine.generate(ids, params, prompt=text, arrival_time=arrival):
                queue.put_nowait((i, output))
        except Exception as error:  # noqa: BLE001 - handed to the handler below
            queue.put_nowait((i, error))

    tasks = [asyncio.create_task(pump(i, text, ids)) for i, (text, ids) in enumerate(prompts)]
    last_token = {}  # (prompt, sample) -> (tokens seen, time of the latest)
    generated = {}  # prompt -> tokens generated for it so far, all samples
    remaining = len(prompts)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                state.metrics.requests.labels("error").inc(remaining * params.n)
                remaining = 0
                if isinstance(item, EngineStepError):
                    raise APIError(500, str(item), type="server_error")
                raise APIError(400, str(item))
            _observe_tokens(state, item, i, last_token)
            generated[i] = sum(len(c.token_ids) for c in item.outputs)
            record.completion_tokens = sum(generated.values())
            if item.finished:
                remaining -= 1
                for c, m in zip(item.outputs, item.per_sample_metrics):
                    state.metrics.on_finished(m, c.finish_reason or "abort", len(item.prompt_token_ids))
            yield i, item
    finally:
        if remaining:  # the client went away before these finished
            state.metrics.requests.labels("cancelled").inc(remaining * params.n)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _observe_tokens(state: ServerState, output: RequestOutput, i: int, last_token: dict) -> None:
    """Inter-token latency: the gap since a sample's previous tokens, spread over the new ones."""
    now = time.monotonic()
    for c in output.outputs:
        seen, then = last_token.get((i, c.index), (0, None))
        new = len(c.token_ids) - seen
        if new > 0:
            if then is not None:
                for _ in range(new):
                    state.metrics.inter_token_latency.observe((now - then) / new)
            last_token[(i, c.index)] = (len(c.token_ids), now)


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * count
    async for i, output in outputs:
        if output.finished:
            finals[i] = output
    return finals


async def _send_events(request: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`. A failure mid-stream is sent
    as an error event (the status line has already gone out as 200)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    chunk = await anext(chunks, None)  # a failure before the first chunk still gets a proper status
    await response.prepare(request)
    try:
        while chunk is not None:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            chunk = await anext(chunks, None)
    except APIError as error:
        await response.write(f"data: {json.dumps(error.body())}\n\n".encode())
    except ConnectionResetError:  # the client left; closing `chunks` (the caller's aclosing) aborts it
        return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _completion_chunks(outputs, req, response_id: str, model: str, echo: list[str],
                             prompt_tokens: int) -> AsyncIterator[dict]:
    n = req.params.n
    deltas: dict[int, responses.ChoiceDeltas] = {}
    completion_tokens = 0
    async for i, output in outputs:
        for c in output.outputs:
            index = i * n + c.index
            first = index not in deltas
            delta = deltas.setdefault(index, responses.ChoiceDeltas(req.params.stop)).advance(c)
            if delta is None:
                continue
            text, tokens, entries, finish_reason = delta
            completion_tokens += len(tokens)
            prefix = echo[i] if first else ""
            logprobs = None
            if entries is not None:
                offset = len(echo[i]) + deltas[index].text_sent - len(text)  # where this delta starts
                logprobs = responses.completion_logprobs(tokens, entries, offset)
            choice = {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish_reason}
            so_far = responses.usage(prompt_tokens, completion_tokens) if req.continuous_usage else None
            yield responses.envelope(response_id, "text_completion", model, [choice], so_far,
                                     with_usage_field=req.include_usage)
    if req.include_usage:
        yield responses.envelope(response_id, "text_completion", model, [],
                                 responses.usage(prompt_tokens, completion_tokens))


async def _chat_chunks(outputs, req, params: SamplingParams, parser: str | None, forced: bool, response_id: str,
                       model: str, prompt_tokens: int) -> AsyncIterator[dict]:
    deltas = [responses.ChoiceDeltas(params.stop) for _ in range(params.n)]
    # With tools, each choice's text goes through the tool-call parser: content deltas as they come,
    # each call in one delta once its block is complete (name, id and the whole arguments).
    parsers = [tool_calls.TOOL_CALL_PARSERS[parser](forced) for _ in range(params.n)] if parser else None
    completion_tokens = 0

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        so_far = responses.usage(prompt_tokens, completion_tokens) if req.continuous_usage else None
        return responses.envelope(response_id, "chat.completion.chunk", model, [choice], so_far,
                                  with_usage_field=req.include_usage)

    for index in range(params.n):  # the role comes first, before any content
        yield chunk(index, {"role": "assistant", "content": ""})
    async for _, output in outputs:
        for c in output.outputs:
            delta = deltas[c.index].advance(c)
            if delta is None:
                continue
            text, tokens, entries, finish_reason = delta
            completion_tokens += len(tokens)
            calls = []
            if parsers is not None:
                text, calls = parsers[c.index].feed(text, final=finish_reason is not None)
            if text or entries:
                logprobs = None if entries is None else responses.chat_logprobs(tokens, entries)
                yield chunk(c.index, {"content": text}, logprobs)
            first = len(parsers[c.index].calls) - len(calls) if calls else 0
            for number, call in enumerate(calls, first):
                yield chunk(c.index, {"tool_calls": [{"index": number, **call}]})
            if finish_reason is not None:
                if parsers is not None and parsers[c.index].calls:
                    finish_reason = responses.tool_finish_reason(finish_reason)
                yield chunk(c.index, {}, finish_reason=finish_reason)
    if req.include_usage:
        yield responses.envelope(response_id, "chat.completion.chunk", model, [],
                                 responses.usage(prompt_tokens, completion_tokens))
