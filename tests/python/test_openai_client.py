"""The official `openai` Python client against a running `pagoda serve` on SmolLM2.

Run by tests/server_openai_python.rs, which starts the server and sets PAGODA_BASE_URL,
PAGODA_API_KEY and PAGODA_MODEL.
"""

import json
import os

import jsonschema
import openai
import pytest

BASE_URL = os.environ["PAGODA_BASE_URL"]
API_KEY = os.environ["PAGODA_API_KEY"]
MODEL = os.environ["PAGODA_MODEL"]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, timeout=120, max_retries=0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_max_tokens_length(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=16,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_stop(client):
    base = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0
    ).choices[0].text
    stop = base[3:5]
    cut = base.index(stop)
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == base[:cut]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text

    a = sample(1234)
    assert a == sample(1234)
    others = {sample(s) for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds all gave the same text"


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3
        assert abs(max(top.values()) - chosen) < 1e-4


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4


def test_authentication_failure():
    bad = openai.OpenAI(base_url=BASE_URL, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401


def test_invalid_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=17
        )
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=3, best_of=2, max_tokens=2)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)


def test_n_choices_streamed_and_not(client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a fact."}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
    )
    full = client.chat.completions.create(**args)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [""] * 3
    finishes = [None] * 3
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == [c.message.content for c in full.choices]
    assert finishes == [c.finish_reason for c in full.choices]
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, best_of=4, max_tokens=4, temperature=1.0, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON: name, age and city."}],
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    for temperature, seed in [(0, None), (1.0, 3), (1.0, 4)]:
        r = client.chat.completions.create(temperature=temperature, seed=seed, **args)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        text = ""
        for chunk in client.chat.completions.create(
            stream=True, temperature=temperature, seed=seed, **args
        ):
            for c in chunk.choices:
                text += c.delta.content or ""
        assert text == r.choices[0].message.content
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object whose key 'answer' is 'yes'."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"guided_regex": "(unclosed"},
        )
    assert e.value.body["param"] == "guided_regex"
