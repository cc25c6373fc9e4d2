"""Two chat turns with the GGUF's own chat template; the second turn reuses both KV caches.

    python examples/chat_turns.py TARGET.gguf DRAFT.gguf
"""
import sys

from llamaspec import load_pair
from llamaspec.chat_template import ChatTemplate

with load_pair(sys.argv[1], sys.argv[2], n_gpu_layers=-1, n_ctx=4096) as pair:
    template = ChatTemplate.from_model_info(pair.target.info)
    messages = [{"role": "user", "content": "Name three sorting algorithms."}]
    for follow_up in ("Which one is stable?", None):
        prompt = template.render(messages)
        reply = pair.generate(pair.tokenize(prompt, add_special=template.add_special_for(prompt)), max_tokens=200)
        print(reply.text, "\n--", reply.stats.summary(), f"(cached prompt tokens: {reply.stats.prompt_tokens_cached})")
        messages.append({"role": "assistant", "content": reply.text})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
