"""A stand-in for llama.cpp's llama-server, for the benchmark's client tests: it takes the flags llama-server
takes (only --host and --port matter), answers /health with 503 for its first half second (a model loading) and
200 after, and /completion with llama-server's `timings` fields: predicted_n = n_predict, predicted_ms = 4 ms a
token, and draft_n / draft_n_accepted. Every request body is appended (one JSON line) to $FAKE_SERVER_LOG.
FAKE_SERVER_FAIL=1 makes it print an error and exit at start, as a server that cannot load the case does.

/v1/chat/completions streams as llama-server does with stream=True: a role chunk, one content chunk ("ok"), the
finish chunk, then with stream_options.include_usage an empty-choices chunk with `usage`; the last chunk carries
`timings`. Its prompt is the request's messages and tools as JSON, one "token" per 4 characters, and one slot
keeps the last prompt: cache_n is the prefix shared with it (in whole tokens), prompt_n the rest.
FAKE_SERVER_CHAT_FAIL_AT=N answers the N-th chat request (0-based) with HTTP 500, as a server that cannot
render or decode a prompt does."""
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()
CHARS_PER_TOKEN = 4
SLOT = {"prompt": "", "requests": 0}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/health":
            return self._reply(404, {"error": "not found"})
        if time.monotonic() - STARTED < 0.5:
            return self._reply(503, {"error": {"message": "Loading model"}})
        self._reply(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_SERVER_LOG"], "a") as log:
            log.write(json.dumps(body) + "\n")
        if self.path == "/v1/chat/completions":
            return self._chat(body)
        n = int(body.get("n_predict", 16))
        self._reply(200, {"content": "x" * n, "timings": {
            "prompt_n": 5, "prompt_ms": 1.0, "predicted_n": n, "predicted_ms": 4.0 * n,
            "predicted_per_second": 250.0, "draft_n": 2 * n, "draft_n_accepted": n}})


    def _chat(self, body: dict) -> None:
        n_request = SLOT["requests"]
        SLOT["requests"] += 1
        if os.environ.get("FAKE_SERVER_CHAT_FAIL_AT") == str(n_request):
            print(f"decode: failed to render request {n_request}", file=sys.stderr, flush=True)
            return self._reply(500, {"error": {"code": 500, "message": "failed to decode the prompt",
                                               "type": "server_error"}})
        prompt = json.dumps([body.get("messages"), body.get("tools")])
        shared = 0
        for a, b in zip(prompt, SLOT["prompt"]):
            if a != b:
                break
            shared += 1
        SLOT["prompt"] = prompt
        prompt_tokens = len(prompt) // CHARS_PER_TOKEN
        cache_n = min(shared // CHARS_PER_TOKEN, prompt_tokens - 1)
        n = min(int(body.get("max_tokens", 16)), 2)
        timings = {"cache_n": cache_n, "prompt_n": prompt_tokens - cache_n, "prompt_ms": 1.0, "predicted_n": n,
                   "predicted_ms": 4.0 * n, "predicted_per_second": 250.0}
        chunk = {"object": "chat.completion.chunk", "id": "fake", "model": "fake"}
        events = [chunk | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
                  chunk | {"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                  chunk | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(chunk | {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                            "total_tokens": prompt_tokens + n}})
        events[-1]["timings"] = timings
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    if os.environ.get("FAKE_SERVER_FAIL"):
        print("error: this fake cannot load the model", file=sys.stderr)
        sys.exit(1)
    args = sys.argv[1:]
    host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
    port = int(args[args.index("--port") + 1])
    print("main: server is listening", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
