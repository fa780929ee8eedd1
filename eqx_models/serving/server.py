"""The OpenAI-compatible HTTP API (Starlette on uvicorn) in front of an `Engine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health`, and `GET /metrics` (Prometheus text: free and total KV pages,
running and waiting requests). The engine runs in its own thread; each request
waits on an asyncio queue that the engine's updates are posted to.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..tokenizer import Tokenizer
from .engine import Engine, SequenceUpdate, TokenLogprobs
from .protocol import APIError, GenerationRequest, chat_sampling, parse_chat, parse_completion
from .structured import StructuredOutput
from .tools import CLOSE, OPEN, ToolCallStream, parse_tool_calls, required_call

logger = logging.getLogger("eqx_models.serving")


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
    """Holds the engine, the tokenizer and the served name; builds the Starlette app."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, *, api_key: str | None = None):
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
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
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return _error(APIError("Invalid or missing API key (send 'Authorization: Bearer <key>').", status=401))

    async def _body(self, request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(f"The request body is not valid JSON: {error}.") from None

    def _check_model(self, parsed: GenerationRequest) -> None:
        if parsed.model is not None and parsed.model != self.model_name:
            raise APIError(f"The model `{parsed.model}` does not exist.", status=404, param="model")

    # ------------------------------------------------------------- completions

    async def completions(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            parsed = parse_completion(await self._body(request))
            self._check_model(parsed)
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in parsed.prompts]
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
        if parsed.n > self.engine.max_num_seqs:
            raise APIError(f"'n' is {parsed.n}, more choices than this server runs at once (--max-num-seqs "
                           f"{self.engine.max_num_seqs}); ask for at most that many.", param="n")
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
        client went away first, 500 if the engine failed a step."""
        results = [{"text": "", "logprobs": [], "finish_reason": None, "stop_reason": None, "completion_tokens": 0,
                    "prompt_logprobs": None} for _ in submitted.prompt_ids]
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
        if any(r["finish_reason"] == "abort" for r in results):  # the engine failed a step (see its log)
            return _error(APIError("The engine failed while running this request; see the server log.", status=500))
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

    def _render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The conversation's prompt; with `tools`, a template that leaves them out is refused."""
        try:
            if tools:
                with_tools = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
                if with_tools == self.tokenizer.apply_chat_template(messages, tokenize=False):
                    raise APIError("This model's chat template does not render 'tools', so the model would not see "
                                   "them; use a tool-calling model's tokenizer (--tokenizer) or send no tools.",
                                   param="tools")
                return self.tokenizer.encode(with_tools, add_special_tokens=False)
            return self.tokenizer.apply_chat_template(messages)
        except APIError:
            raise
        except Exception as error:  # a template that refuses these messages
            raise APIError(f"The chat template could not render these messages: {error}", param="messages") from None

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
            parsed, messages = parse_chat(await self._body(request))
            self._check_model(parsed)
            tools = parsed.tools if parsed.tool_choice != "none" else None
            prompt_ids = self._render_chat(messages, tools)
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
