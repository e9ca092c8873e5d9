#!/usr/bin/env python3
"""Make tiny random-weight embedding and reranker models, and their reference results.

Writes tests/data/tiny/pooling/<name>/ and tests/data/tiny/pooling/references.json:
- embed-mean: a sentence-transformers model (Qwen3 base model, mean pooling, Normalize), its
  tokenizer appending <|endoftext|> as Qwen3-Embedding's does;
- embed-cls: sentence-transformers, CLS (first-token) pooling, no Normalize;
- embed-last: an HF directory without sentence-transformers files (the engine's default:
  last-token pooling, L2-normalized), Matryoshka (is_matryoshka in config.json);
- rerank-cls: Qwen3ForSequenceClassification with one label (a cross-encoder), its pair
  template "$A <|endoftext|> $B <|endoftext|>";
- rerank-tokens: Qwen3ForCausalLM scored by the logits of two tokens (classifier_from_token in
  config.json), as Qwen3-Reranker scores with "no" and "yes".
The references come from sentence-transformers (embeddings, the cross-encoder) and transformers
(the token reranker: the sigmoid of the two logits' difference at the last position).

usage: make-tiny-pooling.py [--out tests/data/tiny/pooling]
Needs the venv of tests/data/tiny/README.md plus sentence-transformers (6.3.0); runs offline
on CPU, deterministic.
"""
import argparse
import json
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from sentence_transformers import CrossEncoder, SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer  # noqa: E402
from tokenizers import Tokenizer, processors  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen3Config  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
BASE_TOKENIZER = os.path.join(HERE, "..", "tests", "data", "tiny", "qwen3", "tokenizer.json")
EOT = "<|endoftext|>"

TEXTS = [
    "The river ran slowly past the old mill.",
    "Children walked to school with their books.",
    "What is the weather like today? The sky is grey.",
    "def add(a, b):\n    return a + b",
]
QUERY = "Where is the old mill?"
DOCUMENTS = [
    "The mill stood dark and quiet by the river.",
    "Farmers brought apples, cheese, honey and eggs.",
    "A train left the station at 10:45.",
]


def config(**kw):
    c = dict(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    c.update(kw)
    return Qwen3Config(**c)


def tokenizer(template):
    tok = Tokenizer.from_file(BASE_TOKENIZER)
    if template:
        eot = tok.token_to_id(EOT)
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOT}", pair=f"$A {EOT} $B {EOT}", special_tokens=[(EOT, eot)]
        )
    return tok


def write_tokenizer(d, template, pad=EOT):
    tokenizer(template).save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT,
                   "pad_token": pad, "model_max_length": 128}, f, indent=2)


def random_model(cls, cfg, seed):
    torch.manual_seed(seed)
    m = cls.from_config(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m


def hf_dir(tmp, name, cls, cfg, seed, template):
    d = os.path.join(tmp, name)
    random_model(cls, cfg, seed).save_pretrained(d, safe_serialization=True)
    write_tokenizer(d, template)
    return d


def ids(tok_dir, *texts):
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    return tok.encode(*texts).ids


def floats(t):
    return [[round(float(x), 7) for x in row] for row in t]


def clean(d):
    for junk in ("README.md", "config_sentence_transformers.json.bak"):
        p = os.path.join(d, junk)
        if os.path.exists(p):
            os.remove(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "data", "tiny", "pooling"))
    out = os.path.abspath(ap.parse_args().out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    refs = {"texts": TEXTS, "query": QUERY, "documents": DOCUMENTS, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode, norm, seed, template in [
            ("embed-mean", "mean", True, 1, True),
            ("embed-cls", "cls", False, 2, False),
        ]:
            src = hf_dir(tmp, name, AutoModelForCausalLM, config(), seed, template)
            word = Transformer(src)
            mods = [word, Pooling(word.get_embedding_dimension(), pooling_mode=mode)]
            if norm:
                mods.append(Normalize())
            st = SentenceTransformer(modules=mods, device="cpu")
            d = os.path.join(out, name)
            st.save(d)
            clean(d)
            emb = st.encode(TEXTS, convert_to_numpy=True, batch_size=1)
            refs["models"][name] = {
                "token_ids": [ids(d, t) for t in TEXTS],
                "embeddings": floats(emb),
            }

        # embed-last: an HF directory only; the reference is sentence-transformers with
        # last-token pooling and Normalize over the same weights.
        d = os.path.join(out, "embed-last")
        cfg = config()
        random_model(AutoModelForCausalLM, cfg, 3).save_pretrained(d, safe_serialization=True)
        write_tokenizer(d, True)
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["is_matryoshka"] = True
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        word = Transformer(d)
        st = SentenceTransformer(
            modules=[word, Pooling(word.get_embedding_dimension(), pooling_mode="lasttoken"),
                     Normalize()], device="cpu")
        refs["models"]["embed-last"] = {
            "token_ids": [ids(d, t) for t in TEXTS],
            "embeddings": floats(st.encode(TEXTS, convert_to_numpy=True, batch_size=1)),
            "embeddings_16": floats(st.encode(TEXTS, convert_to_numpy=True, batch_size=1,
                                              truncate_dim=16, normalize_embeddings=True)),
        }

        # rerank-cls: a one-label sequence classifier, scored by sentence-transformers'
        # CrossEncoder (a sigmoid over the one logit).
        d = os.path.join(out, "rerank-cls")
        # NOTE: its pad token is not the <|endoftext|> the template appends: transformers
        # classifies the last token that is not padding, and would skip it.
        cfg = config(num_labels=1, pad_token_id=2)
        random_model(AutoModelForSequenceClassification, cfg, 4).save_pretrained(
            d, safe_serialization=True)
        write_tokenizer(d, True, pad="<|im_end|>")
        ce = CrossEncoder(d, device="cpu")
        scores = ce.predict([(QUERY, doc) for doc in DOCUMENTS], batch_size=1)
        refs["models"]["rerank-cls"] = {
            "token_ids": [ids(d, QUERY, doc) for doc in DOCUMENTS],
            "scores": [round(float(s), 7) for s in scores],
        }

        # rerank-tokens: a causal LM scored with the logits of two tokens at the last position.
        d = os.path.join(out, "rerank-tokens")
        lm = random_model(AutoModelForCausalLM, config(), 5)
        lm.save_pretrained(d, safe_serialization=True)
        write_tokenizer(d, False)
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        no, yes = "The", "\u0120the"
        c["classifier_from_token"] = [no, yes]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        no_id, yes_id = tok.token_to_id(no), tok.token_to_id(yes)
        rows, scores = [], []
        for doc in DOCUMENTS:
            t = ids(d, QUERY, doc)
            with torch.no_grad():
                logits = lm(torch.tensor([t])).logits[0, -1]
            rows.append(t)
            scores.append(round(float(torch.sigmoid(logits[yes_id] - logits[no_id])), 7))
        refs["models"]["rerank-tokens"] = {"token_ids": rows, "scores": scores}
    refs["versions"] = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "sentence_transformers": __import__("sentence_transformers").__version__,
    }
    with open(os.path.join(out, "references.json"), "w") as f:
        json.dump(refs, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
