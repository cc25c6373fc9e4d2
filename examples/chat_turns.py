"""Two chat turns with the GGUF's own chat template (`pair.chat`); the second turn reuses both KV caches.

    python examples/chat_turns.py TARGET.gguf DRAFT.gguf
"""
import sys

from llamaspec import load_pair

with load_pair(sys.argv[1], sys.argv[2], n_gpu_layers=-1, n_ctx=4096) as pair:
    messages = [{"role": "user", "content": "Name three sorting algorithms."}]
    for follow_up in ("Which one is stable?", None):
        reply = pair.chat(messages, max_tokens=200)
        print(reply.content)
        print("--", reply.stats.summary(), f"(cached prompt tokens: {reply.stats.prompt_tokens_cached})")
        messages.append({"role": "assistant", "content": reply.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
