"""Checking OpenAI-style request bodies, and the error bodies sent back.

Every problem becomes an `APIError` carrying the HTTP status and the field at
fault, rendered as `{"error": {"message", "type", "param", "code"}}`.
"""

import dataclasses
import re
from typing import Any

from .sampling import MAX_LOGPROBS, SamplingParams
from .structured import StructuredOutput


class APIError(Exception):
    """A request the server refuses; `body()` is the JSON error it answers with."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError"}

    def __init__(self, message: str, *, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "BadRequestError"),
                "param": self.param,
                "code": self.status,
            }
        }


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python, but `"max_tokens": true` is not a number.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise APIError(f"'{name}' must be {what}, got {value!r}.", param=name)
    return value


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


@dataclasses.dataclass
class GenerationRequest:
    """The parts of a completions or chat request the engine needs."""

    model: str | None
    prompts: list[str | list[int]]  # text, or token ids
    sampling: list[SamplingParams]  # one per choice (`n` per prompt)
    n: int
    stream: bool
    echo: bool
    include_usage: bool
    max_tokens_given: bool
    tools: list[dict[str, Any]] | None = None  # chat: the functions the model may call
    tool_choice: str | dict[str, Any] = "auto"


def parse_sampling(body: dict, *, default_max_tokens: int | None) -> tuple[dict[str, Any], bool]:
    """Sampling fields of a request, checked; and whether max_tokens was given."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    given = max_tokens is not None
    if given:
        max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", (int,), None, "a positive integer")
        if max_tokens <= 0:
            raise APIError(f"'max_tokens' must be at least 1, got {max_tokens}.", param="max_tokens")
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    if temperature < 0:
        raise APIError(f"'temperature' must be non-negative, got {temperature}.", param="temperature")
    top_p = _field(body, "top_p", (int, float), 1.0, "a number")
    if not 0 < top_p <= 1:
        raise APIError(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p")
    top_k = _field(body, "top_k", (int,), 0, "an integer")
    if top_k < -1:
        raise APIError(f"'top_k' must be -1 (all tokens) or at least 0, got {top_k}.", param="top_k")
    seed = _field(body, "seed", (int,), None, "an integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError(f"'stop' must be a string or a list of non-empty strings, got {stop!r}.", param="stop")
    stop_token_ids = body.get("stop_token_ids") or []
    if not _int_list(stop_token_ids):
        raise APIError("'stop_token_ids' must be a list of integers.", param="stop_token_ids")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _field(body, penalty, (int, float), 0, "a number") != 0:
            raise APIError(f"'{penalty}' is not supported by this server; leave it at 0.", param=penalty)
    fields = dict(
        structured=parse_structured(body),
        max_tokens=max_tokens if given else default_max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_field(body, "ignore_eos", (bool,), False, "true or false"),
    )
    return fields, given


# vLLM's `structured_outputs` keys, and the StructuredOutput fields they set.
STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "grammar",
                   "choice": "choice"}


def parse_structured(body: dict) -> StructuredOutput | None:
    """`response_format` (OpenAI: `text`, `json_object`, `json_schema`) or
    `structured_outputs` (vLLM: one of `json`, `json_object`, `regex`, `grammar`,
    `choice`), checked; None for free text."""
    response_format = _field(body, "response_format", (dict,), None, "an object")
    structured = _field(body, "structured_outputs", (dict,), None, "an object")
    if response_format is not None and structured is not None:
        raise APIError("Give 'response_format' or 'structured_outputs', not both.", param="response_format")
    try:
        if response_format is not None:
            kind = response_format.get("type")
            if kind == "text":
                return None
            if kind == "json_object":
                return StructuredOutput(json_object=True)
            if kind == "json_schema":
                spec = response_format.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError("'response_format.json_schema' must be an object with a 'schema' object.",
                                   param="response_format")
                return StructuredOutput(json_schema=spec["schema"])
            raise APIError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                           param="response_format")
        if structured is not None:
            unknown = sorted(set(structured) - set(STRUCTURED_KEYS))
            if unknown:
                raise APIError(f"Unknown 'structured_outputs' keys {unknown}; use one of {sorted(STRUCTURED_KEYS)}.",
                               param="structured_outputs")
            if "json_object" in structured and structured["json_object"] is not True:
                raise APIError("'structured_outputs.json_object' must be true.", param="structured_outputs")
            return StructuredOutput(**{STRUCTURED_KEYS[key]: value for key, value in structured.items()})
    except (ValueError, TypeError) as error:
        raise APIError(str(error), param="response_format" if response_format is not None else "structured_outputs") \
            from None
    return None


def parse_common(body: dict) -> tuple[int, bool, bool]:
    """`n`, `stream` and `stream_options.include_usage`."""
    n = _field(body, "n", (int,), 1, "a positive integer")
    if n < 1:
        raise APIError(f"'n' must be at least 1, got {n}.", param="n")
    stream = _field(body, "stream", (bool,), False, "true or false")
    options = _field(body, "stream_options", (dict,), {}, "an object")
    include_usage = _field(options, "include_usage", (bool,), False, "true or false")
    return n, stream, include_usage


def _sampling_list(fields: dict[str, Any], n: int, count: int, logprobs: int | None) -> list[SamplingParams]:
    """`n` settings per prompt; with a seed, each of the `n` choices gets its own stream."""
    out = []
    for _ in range(count):
        for choice in range(n):
            seed = fields["seed"]
            if seed is not None and n > 1:
                seed = seed * 1_000_003 + choice
            try:
                out.append(SamplingParams(**{**fields, "seed": seed}, logprobs=logprobs))
            except ValueError as error:
                raise APIError(str(error)) from None
    return out


def parse_completion(body: Any) -> GenerationRequest:
    """A `/v1/completions` body: prompt as text, texts, token ids or lists of them."""
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("'prompt' is required.", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _int_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_int_list(p) and p for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
            "(none of them empty).",
            param="prompt",
        )
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise APIError(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}, got {logprobs!r}.", param="logprobs")
    fields, given = parse_sampling(body, default_max_tokens=16)
    n, stream, include_usage = parse_common(body)
    return GenerationRequest(
        model=_field(body, "model", (str,), None, "a string"),
        prompts=prompts,
        sampling=_sampling_list(fields, n, len(prompts), logprobs),
        n=n,
        stream=stream,
        echo=_field(body, "echo", (bool,), False, "true or false"),
        include_usage=include_usage,
        max_tokens_given=given,
    )


def parse_chat(body: Any) -> tuple[GenerationRequest, list[dict[str, Any]]]:
    """A `/v1/chat/completions` body; returns the request (prompt still to render) and the messages."""
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
        raise APIError("'messages' must be a non-empty list of {\"role\", \"content\"} objects.", param="messages")
    for message in messages:
        if not isinstance(message.get("content", ""), (str, type(None))):
            raise APIError("Only text message 'content' (a string) is supported.", param="messages")
    if body.get("logprobs"):
        raise APIError("'logprobs' is not supported for chat completions by this server.", param="logprobs")
    fields, given = parse_sampling(body, default_max_tokens=None)
    n, stream, include_usage = parse_common(body)
    tools, tool_choice = parse_tools(body)
    if tool_choice not in ("auto", "none") and fields["structured"] is not None:
        raise APIError("A required tool call and 'response_format' cannot both constrain the reply.",
                       param="tool_choice")
    request = GenerationRequest(
        model=_field(body, "model", (str,), None, "a string"),
        prompts=[],
        sampling=[],
        n=n,
        stream=stream,
        echo=False,
        include_usage=include_usage,
        max_tokens_given=given,
        tools=tools,
        tool_choice=tool_choice,
    )
    request.sampling = [fields]  # completed once the prompt length is known
    return request, messages


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_tools(body: dict) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    """`tools` (OpenAI function definitions) and `tool_choice`, checked (the
    parameters schemas are compiled later, by the grammar library)."""
    tools = _field(body, "tools", (list,), None, "a list of tools")
    names = []
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise APIError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{...}}}}.", param="tools")
        name = function.get("name")
        if not (isinstance(name, str) and _FUNCTION_NAME.fullmatch(name)):
            raise APIError(f"tools[{index}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}.",
                           param="tools")
        if name in names:
            raise APIError(f"tools[{index}].function.name {name!r} is given twice.", param="tools")
        names.append(name)
        if not isinstance(function.get("description", ""), str):
            raise APIError(f"tools[{index}].function.description must be a string.", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(f"tools[{index}].function.parameters must be a JSON schema object.", param="tools")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise APIError(f"'tool_choice' must name one of the tools {names}, got {choice!r}.", param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise APIError(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}.",
                       param="tool_choice")
    elif choice == "required" and not names:
        raise APIError("'tool_choice' is 'required' but no 'tools' were given.", param="tool_choice")
    return tools or None, choice


def chat_sampling(request: GenerationRequest, prompt_length: int, max_model_len: int) -> None:
    """Fills in a chat request's settings; without max_tokens it may use the rest of the context."""
    fields = dict(request.sampling[0])
    if fields["max_tokens"] is None:
        fields["max_tokens"] = max(1, max_model_len - prompt_length)
    request.sampling = _sampling_list(fields, request.n, 1, None)
