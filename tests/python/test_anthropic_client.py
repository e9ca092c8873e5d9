"""The official `anthropic` Python client against a running `pagoda serve` on SmolLM2: the
Messages API plain and streamed, stop sequences, count_tokens, errors and auth; its greedy text
must equal the OpenAI chat route's for the same conversation.

Run by tests/server_openai_python.rs, which starts the server and sets PAGODA_BASE_URL (ending
in /v1, which Anthropic's client adds itself), PAGODA_API_KEY and PAGODA_MODEL.
"""

import json
import os

import anthropic
import jsonschema
import openai
import pytest

BASE_URL = os.environ["PAGODA_BASE_URL"]
API_KEY = os.environ["PAGODA_API_KEY"]
MODEL = os.environ["PAGODA_MODEL"]
# NOTE: the SDK (2.x) no longer takes sampling fields as arguments; they go in the body.
GREEDY = {"temperature": 0}
ROOT = BASE_URL.removesuffix("/v1")
SYSTEM = "You are a helpful assistant."
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client():
    # NOTE: the client sends the key as `x-api-key`, as it does to Anthropic.
    return anthropic.Anthropic(base_url=ROOT, api_key=API_KEY, timeout=120, max_retries=0)


def test_message_equals_the_chat_route(client):
    m = client.messages.create(
        model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=24, extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 24 and m.usage.input_tokens > 0
    chat = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0)
    r = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}] + MESSAGES,
        max_tokens=24,
        extra_body=GREEDY,
    )
    assert m.content[0].text == r.choices[0].message.content
    assert m.usage.input_tokens == r.usage.prompt_tokens
    assert m.usage.output_tokens == r.usage.completion_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[r.choices[0].finish_reason]


def test_stream_equals_non_stream(client):
    args = dict(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=16, extra_body=GREEDY)
    full = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        pieces = [t for t in stream.text_stream]
        final = stream.get_final_message()
    assert len(pieces) > 1
    assert "".join(pieces) == full.content[0].text
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    # The raw events, in Anthropic's order.
    events = [e.type for e in client.messages.create(stream=True, **args)]
    assert events[0] == "message_start"
    assert events[-2:] == ["message_delta", "message_stop"]
    assert events.index("content_block_start") < events.index("content_block_delta")
    assert "content_block_stop" in events


def test_stop_sequence(client):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=24, extra_body=GREEDY)
    base = client.messages.create(**args).content[0].text
    stop = base[4:7]
    m = client.messages.create(stop_sequences=[stop], **args)
    assert m.content[0].text == base[: base.index(stop)]
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop


def test_prefill_continues_the_assistant(client):
    m = client.messages.create(
        model=MODEL,
        messages=MESSAGES + [{"role": "assistant", "content": "The three colours are"}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    assert m.content and m.content[0].text


def test_count_tokens(client):
    n = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES)
    m = client.messages.create(
        model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=1, extra_body=GREEDY
    )
    assert n.input_tokens == m.usage.input_tokens


def test_errors(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"temperature": -1})
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=8)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL, messages=[{"role": "user", "content": [image]}], max_tokens=8
        )
    assert "image" in e.value.body["error"]["message"]


def test_authentication():
    bad = anthropic.Anthropic(base_url=ROOT, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a colour as JSON."}],
        max_tokens=40,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)
