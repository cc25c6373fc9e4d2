"""Read llama-server's `timings` from a chat completion: works unchanged against `llamaspec serve` and llama-server.

    python examples/timings_client.py http://127.0.0.1:8080 "Write a haiku about caches."
"""
import json
import sys
import urllib.request

url = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080").rstrip("/") + "/v1/chat/completions"
prompt = sys.argv[2] if len(sys.argv) > 2 else "Write a haiku about caches."
body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 128, "temperature": 0}
request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
with urllib.request.urlopen(request) as response:
    reply = json.load(response)

t = reply["timings"]
print(reply["choices"][0]["message"]["content"])
print(f"prompt: {t['prompt_n']} tokens, {t['prompt_per_second']:.1f} tok/s; "
      f"generation: {t['predicted_n']} tokens, {t['predicted_per_second']:.1f} tok/s")
if "draft_n" in t:
    print(f"drafted {t['draft_n']}, accepted {t['draft_n_accepted']} "
          f"({t['draft_n_accepted'] / max(t['draft_n'], 1):.0%})")
