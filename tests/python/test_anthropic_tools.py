"""Tool use with the official `anthropic` client against `pagoda serve` on Qwen2.5-Coder,
started with --enable-auto-tool-choice --tool-call-parser hermes: forced (`any`, a named tool)
and automatic, plain and streamed, and the tool's result sent back.

Run by tests/server_openai_python.rs, which starts the server and sets PAGODA_BASE_URL,
PAGODA_API_KEY and PAGODA_MODEL.
"""

import os

import anthropic
import jsonschema
import pytest

ROOT = os.environ["PAGODA_BASE_URL"].removesuffix("/v1")
API_KEY = os.environ["PAGODA_API_KEY"]
MODEL = os.environ["PAGODA_MODEL"]
# NOTE: the SDK (2.x) no longer takes sampling fields as arguments; they go in the body.
GREEDY = {"temperature": 0}

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": WEATHER,
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client():
    return anthropic.Anthropic(base_url=ROOT, api_key=API_KEY, timeout=300, max_retries=0)


@pytest.mark.parametrize(
    "tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}]
)
def test_tool_use_streamed_and_not(client, tool_choice):
    args = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                max_tokens=60, extra_body=GREEDY)
    m = client.messages.create(**args)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    assert "Paris" in uses[0].input["city"]
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == [(u.name, u.input) for u in uses]


def test_the_result_goes_back(client):
    m = client.messages.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "any"},
        max_tokens=60,
        extra_body=GREEDY,
    )
    use = next(b for b in m.content if b.type == "tool_use")
    follow = MESSAGES + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature_c": 21}'},
        ]},
    ]
    r = client.messages.create(
        model=MODEL, messages=follow, tools=TOOLS, max_tokens=40, extra_body=GREEDY
    )
    assert r.stop_reason != "tool_use"
    assert "21" in r.content[0].text


def test_bad_tool_choice(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL, messages=MESSAGES, max_tokens=8,
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )
