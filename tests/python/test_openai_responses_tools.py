"""Function tools through the official `openai` client's Responses API against `pagoda serve`
on Qwen2.5-Coder (--enable-auto-tool-choice --tool-call-parser hermes): forced and automatic,
plain and streamed, and the call's output sent back with `previous_response_id`.

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
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER,
        "strict": True,
    }
]
QUESTION = "What is the weather like in Paris right now?"


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, timeout=300, max_retries=0)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_weather"}, "auto"]
)
def test_function_call_streamed_and_not(client, tool_choice):
    args = dict(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                max_output_tokens=60, temperature=0)
    r = client.responses.create(**args)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "Paris" in arguments["city"]
    events = list(client.responses.create(stream=True, **args))
    assert events[-1].type == "response.completed"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done if i.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == "".join(c.arguments for c in calls)


def test_the_output_goes_back(client):
    r = client.responses.create(
        model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required",
        max_output_tokens=60, temperature=0,
    )
    call = next(o for o in r.output if o.type == "function_call")
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature_c": 21}'}],
    )
    assert not [o for o in follow.output if o.type == "function_call"]
    assert "21" in follow.output_text
    # The same conversation sent whole, without the stored response, gives the same answer.
    whole = client.responses.create(
        model=MODEL, tools=TOOLS, max_output_tokens=40, temperature=0,
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature_c": 21}'}],
    )
    assert whole.output_text == follow.output_text
