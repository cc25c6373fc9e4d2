"""The only package that imports llama_cpp. Above it, everything speaks token ids, numpy arrays and plain
dataclasses; below it is llama.cpp.

- `native`: the llama_cpp import, enums under llamaspec's names, backend start-up, llama.cpp's log callback, load
  watchers (progress of a model load).
- `devices`: llama.cpp's device registry (GPUs, RPC servers) for placement.
- `model`: a loaded GGUF (weights, vocabulary, tokenizer).
- `context`: one sequence's cache; decode at explicit positions, logits as zero-copy views, `keep(n)`. Every
  decode of every context below goes through its one timed call (`Context._timed_decode`: decode_seconds and
  decode_calls, and the error when llama.cpp refuses a batch).
- `rollback`: how a context's memory goes back to n tokens (the engine never learns which way).
- `sequences`: several sequences in one context (batching); `tree`: a target context holding branches.
- `state_cache`: saved sequence states in host memory, within a budget (a session that comes back to a slot
  another session took).
- `mtp`: an MTP head's context over its target's, for one sequence or a head sequence per shared sequence;
  `hidden`: the context of a draft bound to the target's hidden states (EAGLE-3, DFlash).

It knows nothing of drafting, acceptance or policies.
"""
from .context import Context
from .devices import Device, add_rpc_servers, devices, rpc_hello, supports_rpc
from .model import Model
from .native import (LoadWatcher, default_threads, env_flag, init_backend, library_version, native_log,
                     supports_gpu_offload, system_info, watch_loads)

__all__ = ["Context", "Model", "Device", "devices", "add_rpc_servers", "rpc_hello", "supports_rpc",
           "default_threads", "env_flag", "init_backend", "library_version", "native_log", "supports_gpu_offload",
           "system_info", "LoadWatcher", "watch_loads"]
