"""`eqx-models serve` started for real on 127.0.0.1, spoken to with the `openai` client."""

import concurrent.futures
import json
import shutil
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import QWEN_TOKENIZER, STORIES, require_fixture

import eqx_models

PROMPTS = ["Once upon a time", "The cat", "Lily wanted to play with her friend because", "Tom", "A big dog"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server subprocess, its base URL, an `openai` client, and its log."""

    def __init__(self, model: str, *flags: str, api_key: str | None = None, log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "eqx_models.cli", "serve", model, "--port", str(self.port), *flags]
        if api_key:
            command += ["--api-key", api_key]
        self.log = log
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        else:
            raise RuntimeError("the server did not come up within 120 s")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()}

    def close(self) -> bool:
        """Sends SIGTERM; whether the server shut down cleanly (uvicorn re-raises the
        signal once its shutdown is complete, so the exit status is -SIGTERM)."""
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.seek(0)
        return "Application shutdown complete" in self.log.read()


@pytest.fixture(scope="module")
def stories():
    path = require_fixture(STORIES)
    return eqx_models.from_pretrained(path), eqx_models.load_tokenizer(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    served = Served(str(require_fixture(STORIES)), "--served-model-name", "stories", "--page-size", "4",
                    "--max-num-seqs", "16", "--max-num-batched-tokens", "64", log=log)
    yield served
    assert served.close()


def greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    return eqx_models.generate(model, tokenizer.encode(prompt), max_new_tokens=max_tokens)[0].tolist()


def continuation(tokenizer, prompt: str, ids: list[int]) -> str:
    prompt_ids = tokenizer.encode(prompt)
    return tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]


def test_greedy_completion_equals_generate_with_exact_usage(server, stories):
    model, tokenizer = stories
    response = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=20, temperature=0)
    ids = greedy(model, tokenizer, "Once upon a time", 20)
    (choice,) = response.choices
    assert choice.text == continuation(tokenizer, "Once upon a time", ids)
    assert choice.finish_reason == "length" and response.object == "text_completion"
    prompt_tokens = len(tokenizer.encode("Once upon a time"))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        prompt_tokens, 20, prompt_tokens + 20)
    by_ids = server.client.completions.create(model="stories", prompt=tokenizer.encode("Once upon a time"),
                                              max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == choice.text
    assert [m.id for m in server.client.models.list().data] == ["stories"]


def test_stop_string_and_stop_token(server, stories):
    model, tokenizer = stories
    ids = greedy(model, tokenizer, "Once upon a time", 30)
    text = continuation(tokenizer, "Once upon a time", ids)
    response = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=30,
                                                temperature=0, stop=["Lily"])
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (text[: text.index("Lily")], "stop")
    assert choice.model_extra["stop_reason"] == "Lily"
    response = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=30,
                                                temperature=0, extra_body={"stop_token_ids": [ids[5]]})
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == ids.index(ids[5]) + 1


def test_streaming_concatenates_to_the_plain_text(server):
    kwargs = dict(model="stories", prompt=PROMPTS[2], max_tokens=40, temperature=0)
    plain = server.client.completions.create(**kwargs).choices[0].text
    chunks = list(server.client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40


def test_echo_n_and_logprobs(server, stories):
    model, tokenizer = stories
    echoed = server.client.completions.create(model="stories", prompt="The cat", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "The cat" + continuation(tokenizer, "The cat", greedy(model, tokenizer, "The cat", 8))
    several = server.client.completions.create(model="stories", prompt=["The cat", "Tom"], n=3, max_tokens=8,
                                               temperature=1.0, seed=5)
    assert [c.index for c in several.choices] == list(range(6))
    assert len({c.text for c in several.choices[:3]}) > 1  # each choice draws its own tokens
    assert several.usage.completion_tokens == 6 * 8
    scored = server.client.completions.create(model="stories", prompt="The cat", max_tokens=5, temperature=0, logprobs=3)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == scored.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and chosen <= 0 and chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy
    with_prompt = server.client.completions.create(model="stories", prompt="The cat", max_tokens=2, temperature=0,
                                                   logprobs=1, echo=True).choices[0].logprobs
    prompt_length = len(tokenizer.encode("The cat"))
    assert len(with_prompt.tokens) == prompt_length + 2 and with_prompt.token_logprobs[0] is None
    assert all(lp <= 0 for lp in with_prompt.token_logprobs[1:])


def test_32_concurrent_requests_each_get_what_they_get_alone(server, stories):
    model, tokenizer = stories
    rng = np.random.default_rng(0)
    words = "the a cat dog ran sun big little Lily Tom park happy tree saw".split()
    prompts = [" ".join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(32)]
    lengths = [int(n) for n in rng.integers(1, 40, size=32)]

    def ask(i):
        response = server.client.completions.create(model="stories", prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        return response.choices[0].text, response.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    expected = eqx_models.generate(model, [tokenizer.encode(p) for p in prompts], max_new_tokens=max(lengths))
    for prompt, n, row, (text, count) in zip(prompts, lengths, expected, answers):
        assert (text, count) == (continuation(tokenizer, prompt, row[:n].tolist()), n)
    metrics = server.metrics()
    assert metrics["eqx_models_kv_pages_free"] == metrics["eqx_models_kv_pages_total"]
    assert metrics["eqx_models_num_requests_running"] == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, stories):
    model, tokenizer = stories
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."
    ask = lambda: server.client.completions.create(model="stories", prompt=prompt, max_tokens=8, temperature=0)
    first = ask().choices[0].text
    before = server.metrics()
    second = ask().choices[0].text
    after = server.metrics()
    assert first == second == continuation(tokenizer, prompt, greedy(model, tokenizer, prompt, 8))
    # Every full page but the one holding the last prompt token came from the cache.
    hits = after["eqx_models_prefix_cache_hits_total"] - before["eqx_models_prefix_cache_hits_total"]
    assert hits == (len(tokenizer.encode(prompt)) - 1) // 4 * 4
    assert 0 < after["eqx_models_prefix_cache_hit_rate"] <= 1 and after["eqx_models_prefix_cache_pages"] > 0


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server):
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(l for l in lines if l.startswith("data:"))
        assert server.metrics()["eqx_models_num_requests_running"] == 1
    deadline = time.time() + 10
    while server.metrics()["eqx_models_num_requests_running"] and time.time() < deadline:
        time.sleep(0.05)
    metrics = server.metrics()
    assert metrics["eqx_models_num_requests_running"] == 0
    assert metrics["eqx_models_kv_pages_free"] == metrics["eqx_models_kv_pages_total"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "stories", "max_tokens": 5}, 400, "prompt"),
        ({"model": "stories", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "stories", "prompt": "x", "max_tokens": 600}, 400, None),  # beyond max-model-len 512
        ({"model": "stories", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "stories", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": "stories", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": "stories", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "stories", "prompt": 7}, 400, "prompt"),
        ({"model": "stories", "prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"model": "stories", "prompt": "x", "top_k": 2**31}, 400, "top_k"),  # failed the whole step: every request 500
        ({"model": "stories", "prompt": "x", "temperature": 1e39}, 400, "temperature"),
        ({"model": "stories", "prompt": "x", "stop": ""}, 400, "stop"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, status)
    assert server.client.completions.create(model="stories", prompt="Tom", max_tokens=2).choices[0].text


def test_a_body_above_the_default_limit_gets_413_with_or_without_a_content_length(server):
    body = b'{"model": "stories", "prompt": "' + b"x" * (8 << 20) + b'"}'
    declared = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60)
    assert declared.status_code == 413 and "at most 8388608 bytes" in declared.json()["error"]["message"]
    chunks = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))  # sent chunked
    streamed = httpx.post(f"{server.url}/v1/completions", content=chunks, timeout=60)
    assert streamed.status_code == 413 and httpx.get(f"{server.url}/health").status_code == 200


def test_malformed_json_is_a_400(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="stories", prompt="x", max_tokens=600)


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory, stories):
    """Stories with "." as its EOS token, a deliberately small page pool without
    prefix caching, and an API key."""
    folder = tmp_path_factory.mktemp("stories_dot_eos")
    for item in require_fixture(STORIES).iterdir():
        shutil.copy(item, folder / item.name)
    _, tokenizer = stories
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = tokenizer.backend.token_to_id(".")
    (folder / "generation_config.json").write_text(json.dumps(config))
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    served = Served(str(folder), "--served-model-name", "stories", "--page-size", "4", "--num-pages", "16",
                    "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--no-prefix-caching", api_key="sesame",
                    log=log)
    yield served
    assert served.close()


def test_without_the_api_key_requests_get_401(small_pool_server):
    response = httpx.post(f"{small_pool_server.url}/v1/completions", json={"model": "stories", "prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert httpx.get(f"{small_pool_server.url}/v1/models").status_code == 401
    assert small_pool_server.client.models.list().data[0].id == "stories"


def test_eos_ends_with_stop_and_a_burst_bigger_than_the_pool_completes(small_pool_server, stories):
    model, tokenizer = stories
    dot = tokenizer.backend.token_to_id(".")
    response = small_pool_server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40,
                                                           temperature=0)
    assert response.choices[0].finish_reason == "stop" and response.choices[0].model_extra["stop_reason"] is None
    assert response.choices[0].text.endswith(".")

    def ask(prompt):
        response = small_pool_server.client.completions.create(model="stories", prompt=prompt, max_tokens=40,
                                                               temperature=0, extra_body={"ignore_eos": True})
        return response.choices[0].text

    prompts = PROMPTS + ["The sun was", "One day", "Max had"]  # 8 x ~45 tokens: needs ~90 pages of 16
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, prompts))
    for prompt, text in zip(prompts, texts):
        assert text == continuation(tokenizer, prompt, greedy(model, tokenizer, prompt, 40))
    small_pool_server.log.seek(0)
    assert "preempting" in small_pool_server.log.read()
    metrics = small_pool_server.metrics()
    assert metrics["eqx_models_kv_pages_free"] == metrics["eqx_models_kv_pages_total"] == 16
    assert metrics["eqx_models_prefix_cache_hits_total"] == metrics["eqx_models_prefix_cache_pages"] == 0  # off
    assert dot == tokenizer.encode("Lily.")[-1]


def test_real_vocabulary_counts_prompt_tokens_and_renders_chat(tmp_path_factory):
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("qwen_vocab")
    config = tiny_config("qwen3", vocab_size=151936, hidden_size=32, intermediate_size=48, head_dim=8,
                         max_position_embeddings=512, eos_token_id=151645)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer_path = require_fixture(QWEN_TOKENIZER)
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    served = Served(str(folder), "--tokenizer", str(tokenizer_path), "--served-model-name", "Qwen/Qwen3-tiny",
                    "--page-size", "8", log=log)
    try:
        response = served.client.completions.create(model="Qwen/Qwen3-tiny", prompt="Seattle is a", max_tokens=16,
                                                     temperature=0, extra_body={"ignore_eos": True})
        assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == 16
        assert response.model == "Qwen/Qwen3-tiny" and response.id.startswith("cmpl-")
        # Random weights over the byte-level vocabulary emit many pieces of multi-byte
        # characters: streamed pieces must still add up to the same text.
        kwargs = dict(model="Qwen/Qwen3-tiny", prompt="Seattle is a", max_tokens=48, temperature=0,
                      extra_body={"ignore_eos": True})
        plain = served.client.completions.create(**kwargs).choices[0].text
        pieces = [c.choices[0].text for c in served.client.completions.create(**kwargs, stream=True) if c.choices]
        assert "".join(pieces) == plain
        tokenizer = eqx_models.load_tokenizer(tokenizer_path)
        messages = [{"role": "user", "content": "Hello, 世界"}]
        chat = served.client.chat.completions.create(model="Qwen/Qwen3-tiny", messages=messages, max_tokens=5,
                                                     temperature=0)
        assert chat.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))
        assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
        streamed = served.client.chat.completions.create(model="Qwen/Qwen3-tiny", messages=messages, max_tokens=5,
                                                         temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
        check_structured_outputs_and_refusals(served)
    finally:
        assert served.close()


def check_structured_outputs_and_refusals(served):
    """response_format and structured_outputs over HTTP; a bad schema, too many
    choices and a prompt beyond the model refused while another request streams on
    undisturbed."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Plan a trip."}]
    chat = served.client.chat.completions.create(
        model="Qwen/Qwen3-tiny", messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}})
    trip = json.loads(chat.choices[0].message.content)
    assert set(trip) == {"city", "days"} and 1 <= trip["days"] <= 9 and chat.choices[0].finish_reason == "stop"
    choice = served.client.completions.create(model="Qwen/Qwen3-tiny", prompt="Yes or no?", max_tokens=5,
                                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")

    body = {"model": "Qwen/Qwen3-tiny", "prompt": "Seattle is a", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    alone = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(lambda: "".join(
            c.choices[0].text for c in served.client.completions.create(
                model=body["model"], prompt=body["prompt"], max_tokens=64, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) if c.choices))
        bad = httpx.post(f"{served.url}/v1/completions", json={
            "model": "Qwen/Qwen3-tiny", "prompt": "x", "response_format": {
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}})
        assert bad.status_code == 400 and "nonsense" in bad.json()["error"]["message"]
        unknown = httpx.post(f"{served.url}/v1/completions", json={
            "model": "Qwen/Qwen3-tiny", "prompt": "x", "structured_outputs": {"yaml": "a: 1"}})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "structured_outputs"
        too_many = httpx.post(f"{served.url}/v1/completions", json={"model": "Qwen/Qwen3-tiny", "prompt": "x", "n": 33})
        assert too_many.status_code == 400 and "--max-num-seqs 32" in too_many.json()["error"]["message"]
        too_long = httpx.post(f"{served.url}/v1/completions", json={
            "model": "Qwen/Qwen3-tiny", "prompt": list(range(600)), "max_tokens": 1})
        assert too_long.status_code == 400 and "maximum context length is 512" in too_long.json()["error"]["message"]
        assert streaming.result() == alone


def test_a_failing_engine_step_answers_500_and_the_server_recovers(stories):
    from starlette.testclient import TestClient

    from eqx_models.serving import Engine
    from eqx_models.serving.server import Server

    model, tokenizer = stories
    engine = Engine(model, tokenizer, page_size=4, num_pages=64)
    working = engine._forward
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # fail after the pools were donated, as a failing device call would
            working(*args, **kwargs)
            raise RuntimeError("simulated device failure")
        return working(*args, **kwargs)

    engine._forward = fails_once
    prompt = "Once upon a time, there was a little girl named Lily"
    body = {"model": "stories", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    with TestClient(Server(engine, tokenizer, "stories").app()) as client:
        failed = client.post("/v1/completions", json=body)  # its prompt's pages were cached before the failure
        assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
        recovered = client.post("/v1/completions", json=body)
        assert recovered.status_code == 200 and recovered.json()["usage"]["completion_tokens"] == 3
    # The new pools hold zeros: the pages cached before the failure must not be reused.
    assert recovered.json()["choices"][0]["text"] == continuation(tokenizer, prompt, greedy(model, tokenizer, prompt, 3))
    assert engine.stats()["kv_pages_free"] == 64 and engine.stats()["prefix_cache_hits_total"] == 0
