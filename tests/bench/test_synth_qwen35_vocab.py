"""benchmarks/synthetic/synth_mtp.py with Qwen's tokenizer (llama.cpp's ggml-vocab-qwen35.gguf) and chat template:
the next-token cycle runs through text tokens only, so what the model generates is valid UTF-8 and never ends,
and the MTP head still agrees with the trunk at the asked rate.

The vocab file comes from llama.cpp's models/ (the vocab cache, the llama.cpp source build-llama-tools.sh unpacks,
or the llama-cpp-python sdist); the tests skip without it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.gguf_factory import find_vocab_file

from benchmarks.synthetic import synth_mtp
from llamaspec import load_pair
from llamaspec.policy import FixedPolicy

SCRIPT = Path(synth_mtp.__file__)
TEMPLATE = SCRIPT.parent / "templates" / "Qwen3.5-4B.jinja"
AGREE = 0.7


@pytest.fixture(scope="module")
def qwen35_vocab() -> Path:
    found = find_vocab_file("ggml-vocab-qwen35.gguf")
    if found is None:
        pytest.skip("llama.cpp's ggml-vocab-qwen35.gguf unavailable (set LLAMASPEC_VOCAB_DIR or LLAMASPEC_LLAMA_SRC, "
                    "or allow pip to download the llama-cpp-python sdist)")
    return found


@pytest.fixture(scope="module")
def tokenizer(qwen35_vocab) -> synth_mtp.Tokenizer:
    return synth_mtp.Tokenizer(qwen35_vocab, synth_mtp.PRESETS["tiny"]["n_vocab"], None)


def test_sigma_maps_every_token_into_one_cycle_of_text_tokens(tokenizer):
    tokens, types = (tokenizer.fields[k][1] for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    vocab = synth_mtp.Vocabulary(tokenizer.n_vocab, 256, AGREE, seed=0, good=tokenizer.good)
    good = set(tokenizer.good.tolist())
    assert 10_000 < len(good) < tokenizer.n_vocab
    assert set(vocab.sigma.tolist()) <= good                       # every token leads into G
    seen, x = set(), int(tokenizer.good[0])
    for _ in range(len(good)):                                     # G is one cycle
        seen.add(x)
        x = int(vocab.sigma[x])
    assert x == tokenizer.good[0] and seen == good
    decoder = synth_mtp.gpt2_byte_decoder()
    for i in tokenizer.good[::97]:
        assert types[i] == 1
        text = bytes(decoder[ch] for ch in tokens[i]).decode("utf-8")   # valid UTF-8 on its own
        assert "<" not in text and ">" not in text
    for markup in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"):
        assert tokens.index(markup) not in good
    byte_pieces = [i for i, t in enumerate(tokens[:300]) if len(t) == 1 and decoder[t] >= 0x80]  # UTF-8 parts
    assert byte_pieces and not good & set(byte_pieces)
    assert abs(vocab.agreement - AGREE) < 0.01 and not vocab.in_d[~np.isin(np.arange(tokenizer.n_vocab),
                                                                          tokenizer.good)].any()


def test_a_token_outside_the_cycle_has_a_logit_no_sampler_picks(tokenizer):
    vocab = synth_mtp.Vocabulary(tokenizer.n_vocab, 256, AGREE, seed=0, good=tokenizer.good)
    bad = np.setdiff1d(np.arange(tokenizer.n_vocab), tokenizer.good)
    x = np.array([tokenizer.good[5], tokenizer.good[6], bad[0], bad[-1]])
    h = vocab.embeddings(x)
    h *= np.sqrt(256) / np.linalg.norm(h, axis=1, keepdims=True)   # the trunk's rms_norm
    rows = np.unique(np.concatenate([vocab.sigma[x], tokenizer.good[:2000], bad[:2000]]))
    logits = h @ vocab.output_rows(rows, 0.6).T
    is_bad = ~np.isin(rows, tokenizer.good)
    assert (rows[logits.argmax(axis=1)] == vocab.sigma[x]).all()   # the trunk's argmax is sigma(x)
    assert (logits[:, is_bad].max(axis=1) < logits[:, ~is_bad].min(axis=1) - 30).all()   # e^-30 at T=1


@pytest.fixture(scope="module")
def tiny_qwen35(qwen35_vocab, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth-qwen35") / "tiny-qwen35-mtp.gguf"
    run = subprocess.run([sys.executable, str(SCRIPT), str(out), "--preset", "tiny", "--agree", str(AGREE),
                          "--vocab", str(qwen35_vocab), "--chat-template", str(TEMPLATE)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.slow
def test_the_tiny_model_writes_valid_utf8_without_an_end_and_its_head_agrees_at_the_rate(tiny_qwen35, tokenizer):
    with load_pair(str(tiny_qwen35), drafter="mtp", no_repack=True, n_ctx=512, n_threads=2) as pair:
        assert pair.target.info.n_vocab == tokenizer.n_vocab
        assert pair.target.info.chat_template == TEMPLATE.read_text(encoding="utf-8")
        pair.set_policy(FixedPolicy(1, 0.0))     # one draft a step: accepted / drafted estimates the agree rate
        greedy = pair.generate("Read main.py and fix the bug.", max_tokens=96)
        sampled = pair.generate("Read main.py and fix the bug.", max_tokens=64, temperature=0.8, seed=3)
        reply = pair.chat([{"role": "user", "content": "Hello"}], max_tokens=64)
        for c in (greedy, sampled):
            assert c.finish_reason == "length" and not any(pair.target.is_eog(t) for t in c.tokens)
            b"".join(pair.target.token_bytes(t) for t in c.tokens).decode("utf-8")   # raises on invalid UTF-8
            assert set(c.tokens) <= set(tokenizer.good.tolist())
        assert reply.finish_reason == "length" and (reply.reasoning or reply.content).strip()
        rate = greedy.stats.accepted / greedy.stats.drafted
        assert greedy.stats.drafted >= 40 and abs(rate - AGREE) < 0.15, rate
