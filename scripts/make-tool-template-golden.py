#!/usr/bin/env python3
"""Renders Qwen2.5-Coder's chat template (from its GGUF) for a conversation with tools, tool
calls and tool answers, the way transformers' apply_chat_template does (jinja2 with
trim_blocks, lstrip_blocks, loop controls, and transformers' tojson: json.dumps with
ensure_ascii=False), and writes tests/data/golden/qwen_tools.json: the independent reference
for the engine's rendering of tools (tests/tools.rs).

    python3 -m venv /tmp/v && /tmp/v/bin/pip install jinja2 gguf numpy
    /tmp/v/bin/python scripts/make-tool-template-golden.py ~/.cache/pagoda/models/Qwen2.5-Coder-0.5B-Instruct.gguf
"""

import json
import sys

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city <with markup> & symbols, é and 東京",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def main(path):
    reader = gguf.GGUFReader(path)
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    prompt = env.from_string(template).render(
        messages=MESSAGES, tools=TOOLS, add_generation_prompt=True, bos_token="", eos_token=""
    )
    out = {
        "source": "scripts/make-tool-template-golden.py",
        "tools": TOOLS,
        "messages": MESSAGES,
        "prompt": prompt,
    }
    with open("tests/data/golden/qwen_tools.json", "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
