"""The official `openai` client's embeddings (`client.embeddings`) against a running
`pagoda serve --task embed` on the tiny Matryoshka model tests/data/tiny/pooling/embed-last: the
vectors must agree with sentence-transformers' (references.json) as the client decodes them
(it asks for base64 by default and decodes it), as floats, and as base64 asked for by name, with `dimensions`, from token ids, and errors as the client
raises them.

Run by tests/server_openai_python.rs, which starts the server and sets PAGODA_BASE_URL,
PAGODA_API_KEY and PAGODA_MODEL.
"""

import base64
import json
import math
import os
import struct

import openai
import pytest

BASE_URL = os.environ["PAGODA_BASE_URL"]
API_KEY = os.environ["PAGODA_API_KEY"]
MODEL = os.environ["PAGODA_MODEL"]
HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "..", "data", "tiny", "pooling", "references.json")) as f:
    REFS = json.load(f)
TEXTS = REFS["texts"]
WANT = REFS["models"]["embed-last"]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, timeout=120, max_retries=0)


def assert_close(got, want):
    assert len(got) == len(want)
    dot = sum(a * b for a, b in zip(got, want))
    cos = dot / (math.sqrt(sum(a * a for a in got)) * math.sqrt(sum(b * b for b in want)))
    assert cos > 0.9999
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_embeddings_agree_with_sentence_transformers(client, encoding_format):
    kw = {} if encoding_format is None else {"encoding_format": encoding_format}
    r = client.embeddings.create(model=MODEL, input=TEXTS, **kw)
    assert r.object == "list" and r.model == MODEL
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for d, want in zip(r.data, WANT["embeddings"]):
        got = d.embedding
        if encoding_format == "base64":
            # asked for by name, the client hands the string over as it came: f32 little-endian
            raw = base64.b64decode(got)
            got = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert_close(got, want)
    assert r.usage.prompt_tokens == sum(len(t) for t in WANT["token_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens


def test_dimensions_cut_a_matryoshka_embedding(client):
    r = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16)
    assert_close(r.data[0].embedding, WANT["embeddings_16"][0])


def test_token_ids_in(client):
    r = client.embeddings.create(model=MODEL, input=[WANT["token_ids"][2]])
    assert_close(r.data[0].embedding, WANT["embeddings"][2])


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=1000)
    assert "dimensions" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=[list(range(5, 300))])
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}])
    assert "served for embeddings" in str(e.value)
