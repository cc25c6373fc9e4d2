"""The OpenAI-compatible HTTP server (`llamaspec serve`): request validation, one worker thread that owns the pair,
OpenAI response formats, Prometheus metrics and the Starlette app. It knows nothing of how tokens are drafted."""
from .app import ServerConfig, bind, create_app, serve

__all__ = ["ServerConfig", "bind", "create_app", "serve"]
