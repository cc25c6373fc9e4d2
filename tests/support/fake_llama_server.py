"""A stand-in for llama.cpp's llama-server, for the benchmark's client tests: it takes the flags llama-server
takes (only --host and --port matter), answers /health with 503 for its first half second (a model loading) and
200 after, and /completion with llama-server's `timings` fields: predicted_n = n_predict, predicted_ms = 4 ms a
token, and draft_n / draft_n_accepted. Every request body is appended (one JSON line) to $FAKE_SERVER_LOG.
FAKE_SERVER_FAIL=1 makes it print an error and exit at start, as a server that cannot load the case does."""
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()


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
        n = int(body.get("n_predict", 16))
        self._reply(200, {"content": "x" * n, "timings": {
            "prompt_n": 5, "prompt_ms": 1.0, "predicted_n": n, "predicted_ms": 4.0 * n,
            "predicted_per_second": 250.0, "draft_n": 2 * n, "draft_n_accepted": n}})


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
