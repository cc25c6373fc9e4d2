"""Stream a completion with speculative decoding and print the statistics.

    python examples/stream.py TARGET.gguf DRAFT.gguf ["prompt"]
"""
import sys

from llamaspec import load_pair

target, draft = sys.argv[1], sys.argv[2]
prompt = sys.argv[3] if len(sys.argv) > 3 else "def quicksort(arr):"

with load_pair(target, draft, n_gpu_layers=-1, n_ctx=4096) as pair:
    for piece in pair.stream(prompt, max_tokens=256, temperature=0):
        print(piece.text, end="", flush=True)
    print()
    print(pair.last_stats.summary())
