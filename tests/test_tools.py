"""Tool calling on chat: Hermes-style `<tool_call>` blocks parsed into OpenAI
`tool_calls` (whole and streamed), the tools rendered by the chat template, and
`tool_choice` "required" / a named function enforced by a grammar."""

import json
import shutil

import pytest
from conftest import QWEN_TOKENIZER, make_checkpoint, require_fixture, tiny_config
from starlette.testclient import TestClient

import eqx_models
from eqx_models.serving import Engine
from eqx_models.serving.server import Server
from eqx_models.serving.tools import ToolCallStream, parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}

# A Hermes-style template of our own (the fixture's ChatML one has no tools): tools
# listed in a system turn, calls and tool results rendered back.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one with <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def call(name, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_tool_call_blocks_become_calls_and_the_rest_stays_text():
    text = "Let me look.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"zone": "UTC"})
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls("Hi " + broken) == ("Hi " + broken, [])  # not a call: left as text
    assert parse_tool_calls("Plain answer.") == ("Plain answer.", [])
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}')
    assert content is None and calls[0]["function"]["name"] == "get_time"  # the reply ended before the tag


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_pieces_give_the_same_text_and_calls(piece):
    text = "Sure <b>now</b>: " + call("get_weather", {"city": "Oslo", "unit": "celsius"}) + " done <tool"
    stream, sent, calls = ToolCallStream(), "", []
    for start in range(0, len(text), piece):
        out, new = stream.push(text[start : start + piece])
        assert "<tool_call>" not in out and '"name"' not in out  # no piece of a block leaks as text
        sent, calls = sent + out, calls + new
    out, new = stream.finish()
    sent, calls = sent + out, calls + new
    assert sent == "Sure <b>now</b>:  done <tool"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo", "unit": "celsius"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_tools")
    make_checkpoint(folder, tiny_config("qwen3", vocab_size=151936, head_dim=8, max_position_embeddings=512,
                                        eos_token_id=151645))
    for item in require_fixture(QWEN_TOKENIZER).iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    model, tokenizer = eqx_models.from_pretrained(folder), eqx_models.load_tokenizer(folder)
    engine = Engine(model, tokenizer, max_num_seqs=4, page_size=8, num_pages=256)
    with TestClient(Server(engine, tokenizer, "qwen").app()) as client:
        client.tokenizer, client.engine = tokenizer, engine
        yield client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={
        "model": "qwen", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
        "temperature": 0, **body})


def test_a_named_tool_choice_returns_a_call_with_valid_arguments(client):
    response = chat(client, tools=[WEATHER, TIME],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (only,) = choice["message"]["tool_calls"]
    arguments = json.loads(only["function"]["arguments"])
    assert only["function"]["name"] == "get_weather" and set(arguments) == {"city", "unit"}
    assert arguments["unit"] in ("celsius", "fahrenheit") and len(arguments["city"]) <= 12
    # The prompt is the template's rendering with the tools in it.
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    rendered = client.tokenizer.apply_chat_template(messages, tools=[WEATHER, TIME], tokenize=False)
    assert '"name": "get_time"' in rendered
    assert response.json()["usage"]["prompt_tokens"] == len(client.tokenizer.encode(rendered, add_special_tokens=False))


def test_required_calls_one_of_the_tools_and_streams_it(client):
    streamed = client.post("/v1/chat/completions", json={
        "model": "qwen", "messages": [{"role": "user", "content": "What time is it?"}], "max_tokens": 60,
        "temperature": 0, "tools": [WEATHER, TIME], "tool_choice": "required", "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] in ("get_weather", "get_time")
    json.loads(calls[0]["function"]["arguments"])
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = chat(client, messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, TIME],
                 tool_choice="required").json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert whole == calls[0]["function"]  # the same call, greedy


def test_a_conversation_with_calls_and_results_renders(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 12}'},
    ]
    response = chat(client, messages=messages, tools=[WEATHER], max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param, message", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
     "tools", "not a usable JSON schema"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools", "letters, digits"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "must name one of the tools"),
    (dict(tool_choice="required"), "tool_choice", "no 'tools' were given"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot both constrain"),
])
def test_bad_tool_requests_are_refused_with_the_reason(client, body, param, message):
    response = chat(client, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_template_without_tools_is_refused(client):
    plain = eqx_models.load_tokenizer(require_fixture(QWEN_TOKENIZER))  # ChatML that never mentions tools
    try:
        with TestClient(Server(client.engine, plain, "qwen").app()) as other:
            response = chat(other, tools=[WEATHER])
            assert chat(other, tools=[WEATHER], tool_choice="none", max_tokens=2).status_code == 200  # not rendered
    finally:
        client.engine.start()  # the second server stopped the shared engine's loop on its way out
    assert response.status_code == 400 and "does not render 'tools'" in response.json()["error"]["message"]
