"""`llamaspec serve`: an OpenAI-compatible HTTP endpoint (click code only; the app lives in llamaspec.server)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from . import main
from ..config import DEFAULT_CACHE_RAM
from .options import EXIT_ERROR, Bounded, Command, fail, handle_errors, pair_options, reasoning_option
from .pair_choice import load_pair_from_options


@main.command(cls=Command)
@pair_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 exposes the server to your network.")
@click.option("--port", type=Bounded("port"), default=8080, show_default=True, help="0 = any free port.")
@click.option("--api-key", envvar="LLAMASPEC_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health [env LLAMASPEC_API_KEY].")
@click.option("--admin-key", envvar="LLAMASPEC_ADMIN_KEY", default=None,
              help="Key for /admin routes (default: the --api-key; without either, admin is off) "
                   "[env LLAMASPEC_ADMIN_KEY].")
@click.option("--alias", "model_id", default=None, help="Model id clients use (default: the target file's name).")
@click.option("--max-queue", type=Bounded("max_queue"), default=16, show_default=True,
              help="Requests that may wait while the running ones generate; beyond that: 429.")
@click.option("-np", "--parallel", type=Bounded("parallel"), default=1, show_default=True,
              help="Requests generated together (llama.cpp's -np), each in its own slot with -c / N tokens; one "
                   "target pass verifies every slot's draft. Attention and hybrid targets with a draft model, prompt "
                   "lookup, the MTP head or no drafter; EAGLE-3 / DFlash drafters and recurrent drafts serve one "
                   "request at a time (a warning says why).")
@click.option("-cram", "--cache-ram", "cache_ram", type=Bounded("cache_ram"), default=DEFAULT_CACHE_RAM,
              show_default=True,
              help="Host RAM in MiB for saved slot states (llama-server's prompt cache): a session whose slot "
                   "another session took comes back to its state instead of processing its conversation again. "
                   "-1: no limit, 0: off.")
@click.option("--max-body-bytes", type=Bounded("max_body_bytes"), default=4 << 20, show_default=True,
              help="Largest request body accepted (413 beyond).")
@click.option("--shutdown-timeout", type=Bounded("shutdown_timeout"), default=10.0, show_default=True,
              help="Seconds in-flight requests get to finish after Ctrl-C/SIGTERM before they are cancelled.")
@click.option("--read-timeout", type=Bounded("read_timeout"), default=30.0, show_default=True,
              help="Seconds a client gets to send a request's headers, and again its body (then 408 / closed).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Accept this name in the Host header too (repeatable; '*': any). IP addresses, localhost and "
                   "--host are always accepted; other names are refused as a guard against DNS rebinding.")
@click.option("--cors", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Let web pages from ORIGIN (like http://localhost:3000; '*': any) call the server from a "
                   "browser (repeatable). Without it, requests carrying a foreign Origin are refused.")
@click.option("--access-log", is_flag=True, help="Log every request.")
@reasoning_option(help="Thinking for every chat request (the chat template's enable_thinking); auto: the "
                       "template's default. A request's chat_template_kwargs.enable_thinking overrides it.")
@handle_errors
def serve(**opts):
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /metrics)."""
    try:
        from ..server import ServerConfig, bind, create_app
        from ..server import serve as run_server
        from ..server.app import check_keys
    except ImportError as e:
        fail(f"the server needs extra packages ({e.name} is missing): pip install 'llamaspec[server]'")
    check_keys(opts["api_key"], opts["admin_key"])   # before the model loads
    if opts["host"] not in ("127.0.0.1", "localhost", "::1") and not opts["api_key"]:
        click.echo(f"warning: listening on {opts['host']} without --api-key: anyone who can reach this machine "
                   "can use the model", err=True)
    sock = bind(opts["host"], opts["port"])  # a busy port fails now, not after a long model load
    pair = load_pair_from_options(opts, log_loads=True)   # a log line per model, on a terminal or not
    service = None
    try:
        model_id = opts["model_id"] or opts.get("pair_name") or Path(pair.target.path).stem
        config = ServerConfig(
            model_id=model_id, api_key=opts["api_key"], admin_key=opts["admin_key"], max_queue=opts["max_queue"],
            parallel=opts["parallel"],
            max_body_bytes=opts["max_body_bytes"], read_timeout=opts["read_timeout"], bound_host=opts["host"],
            allowed_hosts=tuple(opts["allowed_hosts"]), cors_origins=tuple(opts["cors_origins"]),
            reasoning=opts["reasoning"])
        app = create_app(pair, config)
        service = app.state.service
        if service.parallel_note:
            click.echo(f"warning: {service.parallel_note}", err=True)
        if service.template_error:
            click.echo(f"warning: /v1/chat/completions is unavailable: {service.template_error}", err=True)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        draft = pair.draft.path.name if pair.draft is not None else "none"
        policy = pair.policy.name if pair.speculative else "none"
        slots = f", {opts['parallel']} slots" if service.parallel_note is None and opts["parallel"] > 1 else ""
        ready = (f"llamaspec serve: listening on http://{shown}:{port} (model {model_id!r}, draft {draft}, "
                 f"drafter {pair.drafter_kind}, policy {policy}{slots}; Ctrl-C to stop)")
        run_server(app, sock, shutdown_timeout=opts["shutdown_timeout"], access_log=opts["access_log"],
                   on_ready=lambda: click.echo(ready, err=True))
        click.echo("llamaspec serve: stopped", err=True)
    finally:
        # the worker thread must be idle before the models are freed; one that does not stop (stuck inside
        # llama.cpp) must not meet an interpreter that is shutting down: leave at once, the OS frees the models
        if service is None or service.stop():
            pair.close()
        else:
            click.echo("error: the worker did not stop; exiting without freeing the models", err=True)
            sys.stderr.flush()
            os._exit(EXIT_ERROR)
