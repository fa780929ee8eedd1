"""Checking OpenAI-style request bodies, and the error bodies sent back.

Every problem becomes an `APIError` carrying the HTTP status and the field at
fault, rendered as `{"error": {"message", "type", "param", "code"}}`.
"""

import dataclasses
import json
import re
from typing import Any

from .sampling import MAX_LOGPROBS, SamplingParamError, SamplingParams
from .structured import StructuredOutput


class APIError(Exception):
    """A request the server refuses; `body()` is the JSON error it answers with."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             413: "RequestTooLargeError", 500: "InternalServerError"}

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


# No request needs JSON nested deeper than this; refusing it up front keeps deep
# nesting away from the recursive code further on (templates, grammar compilers).
MAX_JSON_DEPTH = 128


def parse_json(raw: bytes) -> Any:
    """A request body's JSON. Malformed JSON (NaN and Infinity included, which are not
    JSON) or JSON nested more than `MAX_JSON_DEPTH` deep is a 400."""
    too_deep = APIError(f"The request body's JSON is nested more than {MAX_JSON_DEPTH} levels deep.")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise too_deep from None
    except ValueError as error:  # bad JSON or UTF-8, or an integer of more than 4300 digits
        raise APIError(f"The request body is not valid JSON: {error}.") from None
    # It cannot nest deeper than it has opening brackets: most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nested_deeper(body, MAX_JSON_DEPTH):
        raise too_deep
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` deep in `value`."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


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


# Settings this server does not apply, and the value that leaves each off: any other
# value is refused rather than ignored, so that no request is silently sampled
# otherwise than it asked.
NOT_APPLIED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0}


def parse_sampling(body: dict, *, default_max_tokens: int | None) -> tuple[dict[str, Any], bool]:
    """Sampling fields of a request, checked (types here, ranges by `SamplingParams`:
    what the batched sampler can hold); and whether max_tokens was given."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    given = max_tokens is not None
    if given:
        max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", (int,), None, "a positive integer")
    given_stop = body.get("stop")
    stop = [] if given_stop is None else [given_stop] if isinstance(given_stop, str) else given_stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError(f"'stop' must be a non-empty string or a list of non-empty strings, got {given_stop!r}.",
                       param="stop")
    stop_token_ids = body.get("stop_token_ids") or []
    if not _int_list(stop_token_ids):
        raise APIError("'stop_token_ids' must be a list of integers.", param="stop_token_ids")
    _refuse_not_applied(body)
    fields = dict(
        structured=parse_structured(body),
        max_tokens=max_tokens if given else default_max_tokens,
        temperature=_field(body, "temperature", (int, float), 1.0, "a number"),
        top_p=_field(body, "top_p", (int, float), 1.0, "a number"),
        top_k=_field(body, "top_k", (int,), 0, "an integer"),
        seed=_field(body, "seed", (int,), None, "an integer"),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_field(body, "ignore_eos", (bool,), False, "true or false"),
    )
    chat_default = fields["max_tokens"] is None  # chat: set once the prompt's length is known
    _sampling_params({**fields, "max_tokens": 1} if chat_default else fields)  # refused here, before any work
    fields.update(temperature=float(fields["temperature"]), top_p=float(fields["top_p"]))
    return fields, given


def _refuse_not_applied(body: dict) -> None:
    for name, off in NOT_APPLIED.items():
        value = _field(body, name, (int, float), off, "a number")
        if value != off:
            raise APIError(f"'{name}' is not supported by this server: leave it out or at {off}, got {value!r}.",
                           param=name)
    if _field(body, "logit_bias", (dict,), None, "an object"):
        raise APIError("'logit_bias' is not supported by this server: leave it out.", param="logit_bias")


def _sampling_params(fields: dict[str, Any], logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(**fields, logprobs=logprobs)
    except SamplingParamError as error:
        raise APIError(str(error), param=error.field) from None


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


def parse_common(body: dict, max_n: int | None) -> tuple[int, bool, bool]:
    """`n` (at most `max_n`), `stream` and `stream_options.include_usage`."""
    n = _field(body, "n", (int,), 1, "a positive integer")
    if n < 1:
        raise APIError(f"'n' must be at least 1, got {n}.", param="n")
    if max_n is not None and n > max_n:
        raise APIError(f"'n' is {n}, more choices than this server runs at once (--max-num-seqs {max_n}); ask for "
                       "at most that many.", param="n")
    best_of = _field(body, "best_of", (int,), None, "an integer")
    if best_of is not None and best_of != n:
        raise APIError(f"'best_of' is not supported by this server: leave it out or equal to 'n' ({n}), got "
                       f"{best_of}.", param="best_of")
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
            out.append(_sampling_params({**fields, "seed": seed}, logprobs))
    return out


def parse_completion(body: Any, *, max_n: int | None = None) -> GenerationRequest:
    """A `/v1/completions` body: prompt as text, texts, token ids or lists of them;
    `max_n`: the most choices (`n`) a prompt may ask for."""
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
    n, stream, include_usage = parse_common(body, max_n)
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


def parse_chat(body: Any, *, max_n: int | None = None) -> tuple[GenerationRequest, list[dict[str, Any]]]:
    """A `/v1/chat/completions` body; returns the request (prompt still to render) and the
    messages. `max_n`: the most choices (`n`) it may ask for."""
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
        raise APIError("'messages' must be a non-empty list of {\"role\", \"content\"} objects.", param="messages")
    for message in messages:
        if not isinstance(message.get("content", ""), (str, type(None))):
            raise APIError("Only text message 'content' (a string) is supported.", param="messages")
    if _field(body, "logprobs", (bool,), False, "true or false"):
        raise APIError("'logprobs' is not supported for chat completions by this server.", param="logprobs")
    if _field(body, "top_logprobs", (int,), 0, "an integer"):
        raise APIError("'top_logprobs' needs 'logprobs', which this server does not support for chat completions.",
                       param="top_logprobs")
    fields, given = parse_sampling(body, default_max_tokens=None)
    n, stream, include_usage = parse_common(body, max_n)
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
