"""The official `openai` client's Responses API (`client.responses`) against a running
`pagoda serve` on SmolLM2: plain and streamed, structured output, `previous_response_id`,
retrieve and delete, errors. Its greedy text must equal the chat route's for the same
conversation.

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
INSTRUCTIONS = "You are a helpful assistant."
QUESTION = "Name three colours."


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, timeout=120, max_retries=0)


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage


def test_response_equals_the_chat_route(client):
    r = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=24, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    text, usage = chat_text(
        client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 24
    )
    assert r.output_text == text
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == usage.total_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_input_items(client):
    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=16, temperature=0)
    text, _ = chat_text(
        client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 16
    )
    assert r.output_text == text


def test_stream_equals_non_stream(client):
    args = dict(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    full = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if full.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text
    assert events[-1].response.output_text == full.output_text
    # The SDK's stream helper assembles the same response (it returns one only from
    # `response.completed`: room for the whole answer).
    args["max_output_tokens"] = 200
    full = client.responses.create(**args)
    assert full.status == "completed"
    with client.responses.stream(**args) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert streamed == final.output_text == full.output_text


def test_previous_response_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=12, temperature=0)
    follow = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id,
        max_output_tokens=12, temperature=0,
    )
    assert follow.previous_response_id == first.id
    text, usage = chat_text(
        client,
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        12,
    )
    assert follow.output_text == text
    assert follow.usage.input_tokens == usage.prompt_tokens
    # Kept, retrievable and deletable; not kept with store=False.
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=4)
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL, input="Name a colour, as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(
        model=MODEL, input="Name a colour, as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(r.output_text), dict)


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL, input=[{"type": "reasoning", "id": "rs_1", "summary": []}]
        )
    assert "reasoning" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    bad = openai.OpenAI(base_url=BASE_URL, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=MODEL, input="x")
