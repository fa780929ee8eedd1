"""One request never hurts another: settings the sampler cannot hold are refused up
front, a request that fails inside a step fails alone, and oversized, malformed or
slow-to-prepare requests neither crash the server nor hold up its event loop."""

import concurrent.futures
import copy
import json
import logging
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STORIES, require_fixture
from starlette.testclient import TestClient

import eqx_models
from eqx_models.serving import Engine, SamplingParams
from eqx_models.serving.sampling import SamplingParamError, sample_rows
from eqx_models.serving.server import Server

NEIGHBOURS = ["Once upon a time", "The cat", "Lily wanted to play with her friend because", "A big dog"]


@pytest.fixture(scope="module")
def stories():
    path = require_fixture(STORIES)
    return eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)


# ------------------------------------------------------------- sampling settings


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("top_k", 2**31, "from -1 to 2147483647"),  # overflowed the sampler's int32 and failed the whole step
        ("top_k", -2, "from -1 to 2147483647"),
        ("top_k", True, "an integer"),
        ("temperature", 1e39, "from 0 to 3.403e+38"),  # inf once in float32
        ("temperature", float("inf"), "from 0 to 3.403e+38"),
        ("temperature", float("nan"), "from 0 to 3.403e+38"),
        ("temperature", -0.5, "from 0 to 3.403e+38"),
        ("top_p", 0, "in (0, 1]"),
        ("top_p", float("nan"), "in (0, 1]"),
        ("top_p", 1.5, "in (0, 1]"),
        ("max_tokens", 0, "of at least 1"),
        ("max_tokens", True, "of at least 1"),
        ("logprobs", 21, "from 0 to 20"),
        ("stop", ("",), "must not be empty"),
    ],
)
def test_settings_the_sampler_cannot_hold_are_refused_naming_the_field(field, value, allowed):
    # (Mistyped values too; the tests' runtime type checks stop those before `__post_init__`.)
    with pytest.raises(SamplingParamError, match=f"'{field}'") as raised:
        SamplingParams(**{field: value})
    assert raised.value.field == field and allowed in str(raised.value)


def test_a_vanishing_temperature_or_top_p_samples_the_most_likely_token(stories):
    logits = jnp.log(jnp.asarray([0.1, 0.4, 0.05, 0.3, 0.15])) * 30  # gaps of order 10-100
    rows = 64

    def draws(temperature, top_p):
        return np.asarray(sample_rows(
            jnp.tile(logits, (rows, 1)), jnp.full(rows, 3, jnp.int32), jnp.arange(rows, dtype=jnp.int32),
            jnp.full(rows, temperature, jnp.float32), jnp.zeros(rows, jnp.int32), jnp.full(rows, top_p, jnp.float32),
            sampled=True, filters=top_p < 1,
        ))

    # logits / 1e-37 overflowed to inf and the softmax to NaN: token 0 (<unk>) came out.
    for temperature, top_p in [(1e-37, 1.0), (1e-45, 1.0), (1e-37, 0.5), (1.0, 1e-45)]:
        assert (draws(temperature, top_p) == 1).all(), (temperature, top_p)
    model, tokenizer = stories
    engine = Engine(model, tokenizer, page_size=4, num_pages=64)
    prompt = tokenizer.encode("Once upon a time")
    cold, greedy = engine.generate([prompt, prompt], [SamplingParams(max_tokens=12, temperature=1e-37, seed=1),
                                                      SamplingParams(max_tokens=12, temperature=0)])
    assert cold.token_ids == greedy.token_ids and "<unk>" not in cold.text


# ------------------------------------------------- a failure inside a step stays put


def _smuggled_top_k(engine, culprit):
    """A setting that slipped past the checks: the sampler's int32 cannot hold it."""
    object.__setattr__(culprit, "top_k", 2**31)


def _failing_model_call(engine, culprit):
    """The model call fails, after taking the pools, whenever the culprit is in it
    (from its third token on, so that its neighbours have tokens to recompute)."""
    working = engine._forward

    def forward(params, pools, inputs, **flags):
        result = working(params, pools, inputs, **flags)
        rows = np.flatnonzero(inputs["seeds"] == culprit.seed)
        if len(rows) and inputs["counters"][rows[0]] >= 2:
            raise RuntimeError("simulated device failure")
        return result

    engine._forward = forward


def _failing_detokenizer(engine, culprit):
    """Turning the culprit's third token into text raises."""
    new_sequence = engine._new_sequence

    def with_failing_decoder(prompt_ids, params, *args):
        sequence = new_sequence(prompt_ids, params, *args)
        if params is culprit:
            push, calls = sequence.decoder.push, []

            def fails_third(ids):
                calls.append(ids)
                if len(calls) == 3:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
                return push(ids)

            sequence.decoder.push = fails_third
        return sequence

    engine._new_sequence = with_failing_decoder


@pytest.mark.parametrize("fault", [_smuggled_top_k, _failing_model_call, _failing_detokenizer])
def test_a_failing_request_fails_alone_and_its_neighbours_get_what_they_get_without_it(stories, fault, caplog):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, max_num_seqs=8, page_size=4, num_pages=128)
    prompts = [tokenizer.encode(p) for p in NEIGHBOURS]
    params = [SamplingParams(max_tokens=16, temperature=0), SamplingParams(max_tokens=12, temperature=0.8, seed=3),
              SamplingParams(max_tokens=16, temperature=0, stop=("Lily",)), SamplingParams(max_tokens=9, top_k=5, seed=4)]
    without = engine.generate(prompts, params)

    culprit = SamplingParams(max_tokens=16, temperature=0.7, top_k=40, seed=4242)
    fault(engine, culprit)
    with caplog.at_level(logging.ERROR, logger="eqx_models.serving"):
        *outs, failed = engine.generate(prompts + [tokenizer.encode("The dog")], params + [culprit])
    for out, alone in zip(outs, without):
        assert (out.token_ids, out.text, out.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert failed.finish_reason == "abort" and "The engine failed while running this request" in failed.error
    assert any(record.levelno == logging.ERROR for record in caplog.records)
    # The engine serves on, and every page came back.
    (again,) = engine.generate(prompts[:1], params[0])
    assert again.token_ids == without[0].token_ids
    assert engine.stats()["kv_pages_free"] == 128 and engine.stats()["num_requests_running"] == 0


# ---------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def chat_tokenizer(stories):
    _, tokenizer = stories
    chatty = copy.copy(tokenizer)
    chatty.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return chatty


@pytest.fixture(scope="module")
def client(stories, chat_tokenizer):
    model, _ = stories
    engine = Engine(model, chat_tokenizer, page_size=4, num_pages=64)
    server = Server(engine, chat_tokenizer, "stories", max_request_bytes=20_000, chat_template_seconds=1.0)
    with TestClient(server.app()) as client:
        client.server = server
        yield client


def test_a_failing_request_answers_500_with_its_error_and_its_neighbours_200(client, stories):
    model, tokenizer = stories
    engine = client.server.engine
    body = lambda prompt, seed: {"model": "stories", "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": seed}
    expected = [client.post("/v1/completions", json=body(p, 5)).json()["choices"][0]["text"] for p in NEIGHBOURS]
    working = engine._forward
    _failing_model_call(engine, SamplingParams(seed=666))
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda args: client.post("/v1/completions", json=body(*args)),
                                    [(p, 5) for p in NEIGHBOURS] + [("The dog", 666)]))
        streamed = client.post("/v1/completions", json={**body("The dog", 666), "stream": True}).text
    finally:
        engine._forward = working
    *neighbours, failed = answers
    assert [a.json()["choices"][0]["text"] for a in neighbours] == expected
    assert failed.status_code == 500 and "simulated device failure" in failed.json()["error"]["message"]
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "simulated device failure" in events[-1]["error"]["message"] and streamed.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "top_k": 2**31}, "top_k"),
        ({"prompt": "x", "temperature": 1e39}, "temperature"),
        ({"prompt": "x", "stop": ""}, "stop"),  # the list form [""] was refused, the string accepted
        ({"prompt": "x", "stop": ["a", ""]}, "stop"),
        ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),  # ignored before: sampled otherwise than asked
        ({"prompt": "x", "repetition_penalty": 1.3}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 0.1}, "min_p"),
        ({"prompt": "x", "min_tokens": 4}, "min_tokens"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "n": 10**9}, "n"),  # refused before a billion settings are made
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_fields_are_checked_before_any_work(client, body, param):
    response = client.post("/v1/completions", json=body)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param) and f"'{param}'" in error["message"]
    chat = client.post("/v1/chat/completions", json={**{k: v for k, v in body.items() if k != "prompt"},
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert (chat.status_code, chat.json()["error"]["param"]) == (400, param)


def test_chat_top_logprobs_without_support_is_refused(client):
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "top_logprobs": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"prompt": "x", ', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "nested more than 128 levels"),  # a RecursionError and a 500 before
        (b'{"prompt": "x", "user": ' + b"[" * 200 + b"]" * 200 + b"}", "nested more than 128 levels"),
        (b'{"prompt": "x", "user": NaN}', "NaN is not a JSON value"),
        (b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", "4300 digits"),  # a ValueError and a 500 before
        (b'{"prompt": "\xff"}', "not valid JSON"),
    ],
)
def test_malformed_or_too_deep_json_is_a_400(client, raw, message):
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_a_body_above_the_limit_is_a_413_with_or_without_a_content_length(client):
    fits = {"prompt": "x" * 100, "max_tokens": 1}
    assert client.post("/v1/completions", json=fits).status_code == 200
    big = b'{"prompt": "' + b"x" * 30_000 + b'"}'
    declared = client.post("/v1/completions", content=big)
    assert declared.status_code == 413
    assert "at most 20000 bytes (--max-request-bytes)" in declared.json()["error"]["message"]
    streamed = client.post("/v1/chat/completions", content=iter([big[:10_000], big[10_000:]]))  # chunked
    assert streamed.status_code == 413 and "more than 20000 bytes" in streamed.json()["error"]["message"]


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "Once upon a time"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_health_answers_while_a_slow_prompt_is_tokenised(client, chat_tokenizer, monkeypatch, route, body):
    """The prompt's tokenising (after the chat template's render, on the chat route)
    is held until /health has answered: on the event loop, /health would wait for it
    (a 20 MB prompt took 27 s, and /health waited)."""
    started, release, finished, encode = threading.Event(), threading.Event(), threading.Event(), chat_tokenizer.encode

    def slow_encode(*args, **kwargs):
        started.set()
        release.wait(30)
        finished.set()
        return encode(*args, **kwargs)

    monkeypatch.setattr(chat_tokenizer, "encode", slow_encode)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, route, json={**body, "max_tokens": 2})
        assert started.wait(30)
        assert client.get("/health").status_code == 200
        assert not finished.is_set()  # /health answered while the prompt was still being tokenised
        release.set()
        assert pending.result().status_code == 200


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within 1 s"),
        # Few iterations, so the size limit and not the time limit ends it on a busy machine.
        ("{% for i in range(200) %}{{ 'x' * 1000 }}{% endfor %}", "rendered 200000 characters"),
        # One operation that would take all memory before any limit is looked at.
        ("{{ 'a' * 10**10 }}", "more than the 10000000 items a template may make at once"),
        ("{{ 9**(9**9) }}", "beyond the 10000 allowed"),
    ],
)
def test_a_chat_template_that_runs_away_is_stopped_with_a_400(client, chat_tokenizer, monkeypatch, template, message):
    monkeypatch.setattr(chat_tokenizer, "chat_template", template)
    begun = time.monotonic()
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert time.monotonic() - begun < 30  # the server's limit (1 s in this fixture) ended it
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, "messages") and message in error["message"]
    monkeypatch.undo()
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200


def test_with_an_api_key_health_and_metrics_stay_open_and_v1_needs_it(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, page_size=4, num_pages=16)
    server = Server(engine, tokenizer, "stories", api_key="sesame", max_request_bytes=1000)
    with TestClient(server.app()) as client:
        assert client.get("/health").status_code == 200
        assert "eqx_models_kv_pages_total 16" in client.get("/metrics").text
        key = {"authorization": "Bearer sesame"}
        for method, route in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}):
                assert client.request(method, route, json={}, headers=headers).status_code == 401
        # The key is checked before the body is read: without it a huge body gets 401, not 413.
        assert client.post("/v1/completions", content=b"x" * 5000).status_code == 401
        assert client.post("/v1/completions", content=b"x" * 5000, headers=key).status_code == 413
        assert client.get("/v1/models", headers=key).json()["data"][0]["id"] == "stories"
        response = client.post("/v1/completions", json={"prompt": "Tom", "max_tokens": 2}, headers=key)
        assert response.status_code == 200
