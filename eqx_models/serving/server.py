"""The OpenAI-compatible HTTP API (Starlette on uvicorn) in front of an `Engine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health`, and `GET /metrics` (Prometheus text: free and total KV pages,
running and waiting requests). With an API key, the `/v1` routes need it;
`/health` and `/metrics` stay open. The engine runs in its own thread; each request
waits on an asyncio queue that the engine's updates are posted to. A request's
heavy preparation (parsing its JSON, tokenising, rendering the chat template) runs
in a worker thread, so that a large one never holds up the others on the event loop.
"""

import asyncio
import contextlib
import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..tokenizer import Tokenizer
from .engine import Engine, SequenceUpdate, TokenLogprobs
from .protocol import APIError, GenerationRequest, chat_sampling, parse_chat, parse_completion, parse_json
from .structured import StructuredOutput
from .tools import CLOSE, OPEN, ToolCallStream, parse_tool_calls, required_call

logger = logging.getLogger("eqx_models.serving")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# A chat template gets this long to render one request's messages (a template is
# code from the model's folder: its loops could run for hours) and may produce at
# most this many times --max-request-bytes characters.
CHAT_TEMPLATE_SECONDS = 5.0
CHAT_TEMPLATE_GROWTH = 4


class _TemplateTimeout(BaseException):
    """Raised inside a chat template's render once its time is up; a BaseException, so
    that no `except Exception` on the way out swallows it."""


def _stopped_after(seconds: float, work, *args, **kwargs):
    """`work(*args, **kwargs)` in this thread, stopped by `_TemplateTimeout` once
    `seconds` have passed. A trace function (this thread's only) reads the clock at
    each call of a Python function and at each line of a Jinja template (which
    compiles to Python), so even a template loop with an empty body is stopped."""
    deadline = time.monotonic() + seconds

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TemplateTimeout
        return check if frame.f_code.co_filename == "<template>" else None  # lines: the template's only

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        return work(*args, **kwargs)
    finally:
        sys.settrace(previous)


class _Submitted:
    """The engine requests behind one HTTP request (one per prompt and choice)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue[SequenceUpdate] = asyncio.Queue()
        self.choice_of: dict[str, int] = {}
        self.prompt_ids: list[list[int]] = []  # per choice
        self.open: set[str] = set()

    def add(self, prompt_ids: list[int], sampling, *, prompt_logprobs: bool = False) -> None:
        post = lambda update: self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        request_id = self.engine.add_request(prompt_ids, sampling, on_update=post, prompt_logprobs=prompt_logprobs)
        self.choice_of[request_id] = len(self.prompt_ids)
        self.prompt_ids.append(prompt_ids)
        self.open.add(request_id)

    async def next(self) -> tuple[int, SequenceUpdate]:
        update = await self.updates.get()
        if update.finish_reason is not None:
            self.open.discard(update.request_id)
        return self.choice_of[update.request_id], update

    def abort(self) -> None:
        for request_id in self.open:
            self.engine.abort(request_id)
        self.open.clear()


def _error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _piece(tokenizer: Tokenizer, context: list[int], token_id: int) -> str:
    """The text `token_id` adds after `context` (a token alone can lose its leading
    space, as SentencePiece drops it at the start of a text)."""
    before = tokenizer.decode(context, skip_special_tokens=False)
    after = tokenizer.decode(context + [token_id], skip_special_tokens=False)
    return after[len(before):] if after.startswith(before) else tokenizer.decode([token_id], skip_special_tokens=False)


def _logprobs_block(tokenizer: Tokenizer, entries: list[TokenLogprobs], offset: int, context: list[int]) -> dict:
    """OpenAI's completions `logprobs` object for tokens that follow `context`, text
    offsets counted from `offset`."""
    context = context[-4:]
    block = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        text = _piece(tokenizer, context, entry.token_id)
        block["tokens"].append(text)
        block["token_logprobs"].append(entry.logprob)
        block["top_logprobs"].append({_piece(tokenizer, context, t): lp for t, lp in entry.top})
        block["text_offset"].append(offset)
        offset += len(text)
        context = context[-3:] + [entry.token_id]
    return block


class Server:
    """Holds the engine, the tokenizer and the served name; builds the Starlette app.

    Args:
        engine: the `Engine` that runs the requests (started and stopped with the app).
        tokenizer: tokenises prompts and renders chat templates.
        model_name: the `model` clients send (anything else gets 404).
        api_key: required as `Authorization: Bearer KEY` on the `/v1` routes
            (`/health` and `/metrics` stay open).
        max_request_bytes: larger request bodies are refused with 413 before they
            are read whole.
        chat_template_seconds: the longest a chat template may take to render one
            request (400 beyond).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, *, api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 chat_template_seconds: float = CHAT_TEMPLATE_SECONDS):
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive number of bytes, got {max_request_bytes}.")
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.max_request_bytes, self.chat_template_seconds = max_request_bytes, chat_template_seconds
        self.created = int(time.time())

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            logger.info("serving %s", self.model_name)
            yield
            self.engine.stop()

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        return Starlette(routes=routes, lifespan=lifespan)

    # ------------------------------------------------------------ small routes

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        lines = [f"eqx_models_{name} {value}" for name, value in self.engine.stats().items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        card = {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "eqx_models",
            "root": self.model_name, "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    def _denied(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        sent = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(sent, f"Bearer {self.api_key}".encode()):  # in constant time
            return None
        return _error(APIError("Invalid or missing API key (send 'Authorization: Bearer <key>').", status=401))

    async def _raw_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to be larger than
        `max_request_bytes` (from Content-Length, or while it streams in without one)."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise self._too_large(f"{int(declared)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self._too_large(f"more than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, size: str) -> APIError:
        return APIError(f"The request body is {size}; this server accepts at most {self.max_request_bytes} bytes "
                        "(--max-request-bytes).", status=413)

    def _check_model(self, parsed: GenerationRequest) -> None:
        if parsed.model is not None and parsed.model != self.model_name:
            raise APIError(f"The model `{parsed.model}` does not exist.", status=404, param="model")

    # ------------------------------------------------------------- completions

    async def completions(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            parsed, prompts = await asyncio.to_thread(self._prepare_completion, await self._raw_body(request))
            submitted = self._submit(prompts, parsed, prompt_logprobs=parsed.echo and parsed.sampling[0].logprobs is not None)
        except APIError as error:
            return _error(error)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "created": int(time.time()), "model": self.model_name}
        if parsed.stream:
            return self._stream(request, submitted, parsed, head, chat=False)
        results = await self._collect(request, submitted)
        if isinstance(results, Response):
            return results
        choices = []
        for index, (prompt_ids, result) in enumerate(zip(submitted.prompt_ids, results)):
            text, entries = result["text"], result["logprobs"]
            logprobs = None
            if parsed.sampling[index].logprobs is not None:
                prefix = self.tokenizer.decode(prompt_ids) if parsed.echo else ""
                logprobs = _logprobs_block(self.tokenizer, entries, len(prefix), prompt_ids)
                if parsed.echo:
                    prompt_block = self._prompt_logprobs(prompt_ids, result["prompt_logprobs"])
                    logprobs = {key: prompt_block[key] + logprobs[key] for key in logprobs}
            if parsed.echo:
                text = self.tokenizer.decode(prompt_ids) + text
            choices.append({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": result["finish_reason"], "stop_reason": result["stop_reason"]})
        return JSONResponse({**head, "object": "text_completion", "choices": choices,
                             "usage": self._usage(parsed, submitted, results)})

    def _prepare_completion(self, raw: bytes) -> tuple[GenerationRequest, list[list[int]]]:
        """A completions body parsed and checked, and its prompts' token ids (in a worker thread)."""
        parsed = parse_completion(parse_json(raw), max_n=self.engine.max_num_seqs)
        self._check_model(parsed)
        return parsed, [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in parsed.prompts]

    def _prompt_logprobs(self, prompt_ids: list[int], entries) -> dict:
        """The echoed prompt's part of `logprobs`: the first token has none."""
        first = self.tokenizer.decode([prompt_ids[0]], skip_special_tokens=False)
        block = _logprobs_block(self.tokenizer, entries[1:], 0, prompt_ids[:1])
        offsets, offset = [0], len(first)
        for token in block["tokens"]:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": [first] + block["tokens"], "token_logprobs": [None] + block["token_logprobs"],
                "top_logprobs": [None] + block["top_logprobs"], "text_offset": offsets}

    def _submit(self, prompts: list[list[int]], parsed: GenerationRequest, *, prompt_logprobs: bool = False) -> _Submitted:
        submitted = _Submitted(self.engine)
        try:
            for index, sampling in enumerate(parsed.sampling):
                submitted.add(prompts[index // parsed.n], sampling, prompt_logprobs=prompt_logprobs)
        except ValueError as error:
            submitted.abort()
            raise APIError(str(error)) from None
        return submitted

    def _usage(self, parsed: GenerationRequest, submitted: _Submitted, results: list[dict]) -> dict:
        prompt_tokens = sum(len(ids) for ids in submitted.prompt_ids[:: parsed.n])
        completion_tokens = sum(r["completion_tokens"] for r in results)
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}

    async def _collect(self, request: Request, submitted: _Submitted) -> list[dict] | Response:
        """Waits for every choice to finish; or the response to send instead: 499 if the
        client went away first, 500 (with the engine's reason) if the engine failed it."""
        results = [{"text": "", "logprobs": [], "finish_reason": None, "stop_reason": None, "completion_tokens": 0,
                    "prompt_logprobs": None, "error": None} for _ in submitted.prompt_ids]
        while submitted.open:
            try:
                index, update = await asyncio.wait_for(submitted.next(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    submitted.abort()
                    return Response(status_code=499)
                continue
            result = results[index]
            result["text"] += update.text
            result["logprobs"] += update.logprobs
            result["completion_tokens"] = update.num_output_tokens
            if update.prompt_logprobs is not None:
                result["prompt_logprobs"] = update.prompt_logprobs
            if update.finish_reason is not None:
                result["finish_reason"], result["stop_reason"] = update.finish_reason, update.stop_reason
                result["error"] = update.error
        failed = [r for r in results if r["finish_reason"] == "abort"]
        if failed:  # the engine failed it (see the server log)
            message = next((r["error"] for r in failed if r["error"]), "The engine failed while running this request.")
            return _error(APIError(f"{message} (see the server log)", status=500))
        return results

    def _stream(self, request: Request, submitted: _Submitted, parsed: GenerationRequest, head: dict, *, chat: bool,
                tools: bool = False):
        kind = "chat.completion.chunk" if chat else "text_completion"
        calls = [ToolCallStream() for _ in submitted.prompt_ids] if tools else None

        def event(payload: dict) -> str:
            return f"data: {json.dumps({**head, 'object': kind, **payload}, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            counts = [0] * len(submitted.prompt_ids)
            offsets = [0] * len(submitted.prompt_ids)
            generated: list[list[int]] = [[] for _ in submitted.prompt_ids]
            try:
                for index, prompt_ids in enumerate(submitted.prompt_ids):
                    if chat:
                        delta = {"role": "assistant", "content": ""}
                        yield event({"choices": [{"index": index, "delta": delta, "logprobs": None,
                                                  "finish_reason": None}]})
                    elif parsed.echo:
                        prompt_text = self.tokenizer.decode(prompt_ids)
                        offsets[index] = len(prompt_text)
                        yield event({"choices": [{"index": index, "text": prompt_text, "logprobs": None,
                                                  "finish_reason": None, "stop_reason": None}]})
                while submitted.open:
                    index, update = await submitted.next()
                    counts[index] = update.num_output_tokens
                    if update.error is not None:  # the engine failed this choice: say so, as vLLM does
                        error = APIError(f"choice {index}: {update.error} (see the server log)", status=500)
                        yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
                        continue
                    if not (update.text or update.finish_reason or update.logprobs):
                        continue
                    if calls is not None:
                        choice = _tool_call_choice(index, update, calls[index])
                        if choice is not None:
                            yield event({"choices": [choice]})
                        continue
                    if chat:
                        choice = {"index": index, "delta": {"content": update.text} if update.text else {},
                                  "logprobs": None, "finish_reason": update.finish_reason}
                    else:
                        logprobs = None
                        if parsed.sampling[index].logprobs is not None:
                            context = submitted.prompt_ids[index] + generated[index]
                            logprobs = _logprobs_block(self.tokenizer, update.logprobs, offsets[index], context)
                        generated[index] += update.token_ids
                        offsets[index] += len(update.text)
                        choice = {"index": index, "text": update.text, "logprobs": logprobs,
                                  "finish_reason": update.finish_reason}
                    choice["stop_reason"] = update.stop_reason
                    yield event({"choices": [choice]})
                if parsed.include_usage:
                    results = [{"completion_tokens": c} for c in counts]
                    yield event({"choices": [], "usage": self._usage(parsed, submitted, results)})
                yield "data: [DONE]\n\n"
            finally:
                if submitted.open:  # the client went away mid-stream
                    logger.info("client disconnected; aborting %d sequences", len(submitted.open))
                    submitted.abort()

        return StreamingResponse(events(), media_type="text/event-stream")

    # -------------------------------------------------------------------- chat

    def _prepare_chat(self, raw: bytes) -> tuple[GenerationRequest, list[int], list[dict] | None]:
        """A chat body parsed and checked, its prompt rendered and tokenised, and the
        tools the model sees (in a worker thread)."""
        parsed, messages = parse_chat(parse_json(raw), max_n=self.engine.max_num_seqs)
        self._check_model(parsed)
        tools = parsed.tools if parsed.tool_choice != "none" else None
        return parsed, self._render_chat(messages, tools), tools

    def _render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The conversation's prompt; with `tools`, a template that leaves them out is
        refused. The render is bounded in time and size (400 beyond)."""
        try:
            text = _stopped_after(self.chat_template_seconds, self._render_text, messages, tools)
        except _TemplateTimeout:
            raise APIError(f"The chat template did not finish rendering these messages within "
                           f"{self.chat_template_seconds:g} s, this server's limit.", param="messages") from None
        except APIError:
            raise
        except Exception as error:  # a template that refuses these messages
            raise APIError(f"The chat template could not render these messages: {error}", param="messages") from None
        limit = CHAT_TEMPLATE_GROWTH * self.max_request_bytes
        if len(text) > limit:
            raise APIError(f"The chat template rendered {len(text)} characters from these messages, more than this "
                           f"server's limit of {limit} ({CHAT_TEMPLATE_GROWTH} x --max-request-bytes).",
                           param="messages")
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

    def _render_text(self, messages: list[dict], tools: list[dict] | None) -> str:
        if not tools:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        with_tools = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        if with_tools == self.tokenizer.apply_chat_template(messages, tokenize=False):
            raise APIError("This model's chat template does not render 'tools', so the model would not see them; "
                           "use a tool-calling model's tokenizer (--tokenizer) or send no tools.", param="tools")
        return with_tools

    def _constrain_tool_call(self, parsed: GenerationRequest, tools: list[dict]) -> None:
        """Checks the tools' parameter schemas; with tool_choice "required" or a named
        function, constrains the reply to one call."""
        for index, tool in enumerate(tools):
            parameters = tool["function"].get("parameters")
            try:
                self.engine.check_structured(StructuredOutput(json_schema=parameters or {"type": "object"}))
            except ValueError as error:
                raise APIError(f"tools[{index}].function.parameters is not a usable JSON schema: {error}",
                               param="tools") from None
        if parsed.tool_choice == "auto":
            return
        name = parsed.tool_choice["function"]["name"] if isinstance(parsed.tool_choice, dict) else None
        tags = {tag for tag in (OPEN, CLOSE) if self.tokenizer.backend.token_to_id(tag) is not None}
        parsed.sampling[0]["structured"] = required_call(tools, name, tags)

    async def chat_completions(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            parsed, prompt_ids, tools = await asyncio.to_thread(self._prepare_chat, await self._raw_body(request))
            if tools:
                self._constrain_tool_call(parsed, tools)
            chat_sampling(parsed, len(prompt_ids), self.engine.max_model_len)
            submitted = self._submit([prompt_ids], parsed)
        except APIError as error:
            return _error(error)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "created": int(time.time()), "model": self.model_name}
        if parsed.stream:
            return self._stream(request, submitted, parsed, head, chat=True, tools=bool(tools))
        results = await self._collect(request, submitted)
        if isinstance(results, Response):
            return results
        choices = []
        for index, result in enumerate(results):
            message, finish_reason = {"role": "assistant", "content": result["text"]}, result["finish_reason"]
            if tools:
                content, calls = parse_tool_calls(result["text"])
                if calls:
                    message, finish_reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
            choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason,
                            "stop_reason": result["stop_reason"]})
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": self._usage(parsed, submitted, results)})


def _tool_call_choice(index: int, update: SequenceUpdate, stream: ToolCallStream) -> dict | None:
    """A streamed chat choice with tools: the text outside tool-call blocks, and
    each call once its block is whole (None while nothing is ready)."""
    text, calls = stream.push(update.text)
    finish_reason = update.finish_reason
    if finish_reason is not None:
        rest, last = stream.finish()
        text, calls = text + rest, calls + last
        finish_reason = "tool_calls" if stream.calls else finish_reason
    delta: dict = {"content": text} if text else {}
    if calls:
        first = stream.calls - len(calls)
        delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]
    if not delta and finish_reason is None:
        return None
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": update.stop_reason}


def run(server: Server, host: str, port: int) -> None:
    """Serves until SIGINT/SIGTERM (uvicorn shuts down cleanly on either)."""
    import uvicorn

    uvicorn.run(server.app(), host=host, port=port, log_level="info")
