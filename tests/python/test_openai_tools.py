"""Tool calling with the official `openai` client against `pagoda serve` on Qwen2.5-Coder,
started with --enable-auto-tool-choice --tool-call-parser hermes.

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

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, timeout=300, max_retries=0)


def streamed(stream):
    """The calls of a stream, assembled by index as OpenAI's own examples do."""
    calls = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
            if c.finish_reason:
                finish = c.finish_reason
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"],
)
def test_tool_call_streamed_and_not(client, tool_choice):
    args = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                max_tokens=60, temperature=0)
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "Paris" in arguments["city"]
    calls, finish = streamed(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in choice.message.tool_calls
    ]
    assert all(c["id"] for c in calls)


def test_the_answer_goes_back(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=follow, tools=TOOLS, max_tokens=40, temperature=0
    )
    assert r.choices[0].message.tool_calls is None
    assert "21" in r.choices[0].message.content


def test_bad_tool_choice(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
