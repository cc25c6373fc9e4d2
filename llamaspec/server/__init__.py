"""The OpenAI-compatible HTTP server (`llamaspec serve`). It knows nothing of how tokens are drafted.

validation.py  JSON body -> GenerationRequest, every check naming its field (no template, no tokenizer)
prompt.py      a prompt -> token ids at a cost bounded by the context; message text cannot forge special tokens
worker.py      Job, Worker: the one thread that owns the Pair (testable without HTTP)
formats.py     OpenAI's error, completion and chunk objects, usage, server-sent events
guard.py       Host / Origin checks, CORS, request counting (ASGI middleware)
metrics.py     Prometheus metrics through prometheus_client
openapi.py     the OpenAPI description served at /openapi.json
app.py         the Starlette app: Service and routes
run.py         bind(), serve() on uvicorn
"""
from .app import ServerConfig, create_app
from .run import bind, serve

__all__ = ["ServerConfig", "bind", "create_app", "serve"]
