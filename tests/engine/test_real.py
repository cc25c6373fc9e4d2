"""The engine on the real Qwen2.5-Coder pair (1.5B target, 0.5B draft) and two unrelated tiny real models.

Skipped with a reason when LLAMASPEC_TEST_MODELS does not point at the files made by tests/support/fetch_models.py.
"""
import numpy as np
import pytest

from support.chisq import assert_follows
from conftest import REAL_DRAFT, REAL_GEMMA, REAL_SMOLLM, REAL_TARGET
from support.near_tie import assert_same_or_near_tie
from llamaspec import load_pair
from llamaspec.drafters import common_prefix_len
from llamaspec.errors import IncompatiblePairError
from llamaspec.policy import FixedPolicy, make_policy
from llamaspec.sampling import SamplerConfig, filtered_probs

pytestmark = pytest.mark.realmodel

CODE_PROMPTS = [
    "def quicksort(arr):",
    "# Python: read a CSV file and print the average of the 'price' column\nimport csv\n",
    "function debounce(fn, wait) {",
    "class LRUCache:\n    def __init__(self, capacity):",
    "-- SQL: the ten customers with the highest total order value\nSELECT",
    "fn fibonacci(n: u64) -> u64 {",
    "#include <stdio.h>\n\nint main(void) {\n    // print the first 20 primes\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "// Go: an HTTP handler that returns the current time as JSON\nfunc timeHandler(w http.ResponseWriter, r *http.Request) {",
    "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n",
]
PROSE_PROMPTS = [
    "The history of the printing press begins",
    "Here are five tips for writing clear documentation:\n1.",
    "Once upon a time, in a small village by the sea,",
    "The main differences between TCP and UDP are",
    "Photosynthesis is the process by which",
    "Dear hiring manager,\n\nI am writing to apply for",
    "A recipe for a simple tomato soup:\nIngredients:",
    "The three laws of thermodynamics can be summarised as follows.",
    "In 1969, the Apollo 11 mission",
    "Why is the sky blue? The short answer is",
]

@pytest.fixture(scope="module")
def real_pair(real_models):
    with load_pair(real_models / REAL_TARGET, real_models / REAL_DRAFT, n_ctx=1024, policy="fixed", draft_max=4,
                   no_repack=True) as pair:
        yield pair


def target_logits_after(pair, tokens):
    """The target's logits for the token after `tokens` (one-token decoding of the last one)."""
    ctx = pair.target_ctx
    common = min(common_prefix_len(ctx.tokens, tokens), len(tokens) - 1)
    ctx.keep(common)
    return np.array(ctx.eval(tokens[common:], logits="last")[0])


@pytest.mark.parametrize("prompt", CODE_PROMPTS + PROSE_PROMPTS)
def test_greedy_speculative_output_equals_plain_decoding(real_pair, prompt):
    real_pair.set_policy(FixedPolicy(0))
    plain = real_pair.generate(prompt, max_tokens=128)
    real_pair.set_policy(FixedPolicy(4))
    spec = real_pair.generate(prompt, max_tokens=128)
    assert spec.stats.drafted > 0
    # batched and one-token decoding round differently: a divergence only at a near-tie measured there
    assert_same_or_near_tie(real_pair.target_ctx, real_pair.tokenize(prompt), spec.tokens, plain.tokens)


def test_auto_policy_output_equals_plain_decoding(real_pair):
    real_pair.set_policy(FixedPolicy(0))
    plain = real_pair.generate(CODE_PROMPTS[0], max_tokens=96)
    real_pair.set_policy(make_policy("auto"))
    spec = real_pair.generate(CODE_PROMPTS[0], max_tokens=96)
    assert_same_or_near_tie(real_pair.target_ctx, real_pair.tokenize(CODE_PROMPTS[0]), spec.tokens, plain.tokens)


@pytest.mark.parametrize("device", ["0", "1"], ids=["numpy", "device"])
@pytest.mark.parametrize("prompt, cfg", [
    ("The best thing about summer is", SamplerConfig(temperature=1.0, top_k=12)),
    ("def add(a, b):\n    return", SamplerConfig(temperature=1.0, top_k=12)),
    ("The best thing about summer is", SamplerConfig(temperature=0.8, top_p=0.95)),
], ids=["prose-top_k", "code-top_k", "prose-top_p"])
def test_sampled_next_token_follows_the_target_distribution(real_pair, prompt, cfg, device, monkeypatch):
    """Filters in numpy, and on the device (llama.cpp's sampler chains, run by its CPU backend here)."""
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", device)
    tokens = real_pair.tokenize(prompt)
    p = filtered_probs(target_logits_after(real_pair, tokens), cfg).astype(np.float64)
    real_pair.set_policy(FixedPolicy(3))
    n_samples = 240
    counts = np.zeros(len(p))
    drafted = accepted = 0
    for seed in range(n_samples):
        c = real_pair.generate(tokens, max_tokens=3, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                               seed=seed)
        counts[c.tokens[0]] += 1
        drafted += c.stats.drafted
        accepted += c.stats.accepted
    assert real_pair.target_ctx.device_sampler == (device == "1")
    assert drafted > 0 and accepted > 0  # the draft's tokens were really used
    assert_follows(counts, p)            # nothing outside the target's kept set; chi-square at the 0.1% level


@pytest.mark.parametrize("other, field", [(REAL_SMOLLM, "pre-tokenizer"), (REAL_GEMMA, "vocabulary type")])
def test_unrelated_models_fail_the_pair_check(real_models, other, field):
    with pytest.raises(IncompatiblePairError) as err:
        load_pair(real_models / REAL_TARGET, real_models / other, no_repack=True)
    msg = str(err.value)
    assert field in msg and REAL_TARGET in msg and other in msg
