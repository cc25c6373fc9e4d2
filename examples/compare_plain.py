"""Is speculation faster here? Decode the same prompt plainly and speculatively with one loaded pair, check that
the greedy outputs match, and print both speeds.

    python examples/compare_plain.py TARGET.gguf DRAFT.gguf
"""
import sys

from llamaspec import FixedPolicy, load_pair, make_policy

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."

with load_pair(sys.argv[1], sys.argv[2], n_gpu_layers=-1, n_ctx=2048) as pair:
    pair.generate("warm up", max_tokens=8)
    pair.set_policy(FixedPolicy(0))
    plain = pair.generate(PROMPT, max_tokens=200)
    pair.set_policy(make_policy("auto"))
    spec = pair.generate(PROMPT, max_tokens=200)
    print(f"plain:       {plain.stats.tokens_per_second:6.1f} tok/s")
    print(f"speculative: {spec.stats.tokens_per_second:6.1f} tok/s  ({spec.stats.summary()})")
    print(f"speed-up {spec.stats.tokens_per_second / plain.stats.tokens_per_second:.2f}x; "
          f"same text: {spec.text == plain.text}")
