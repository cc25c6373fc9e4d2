"""Devices: llama.cpp's backend registry (ggml), reached through ctypes on the libggml that llama-cpp-python loaded.
It lists the GPUs, registers llama.cpp RPC servers as devices, and places a model on named devices."""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import ModelLoadError
from .native import init_backend, llama_cpp

_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
_RPC_HELLO = 14                 # RPC_CMD_HELLO, fixed across llama.cpp's RPC protocol versions
_RPC_CAPS_SIZE = 24             # rpc_msg_hello_req: uint8_t conn_caps[24] (protocol 7)
_RPC_LOCK = threading.Lock()
_RPC_ADDED: set[str] = set()


@dataclass(frozen=True)
class Device:
    name: str            # llama.cpp's device name: "CUDA0", "RPC0", "CPU"
    description: str     # "NVIDIA GeForce RTX 3090", "127.0.0.1:50052"
    kind: str            # cpu | gpu | igpu | accel | meta
    backend: str         # the registry it came from: "CUDA", "RPC", "CPU", ...
    free: int            # bytes
    total: int


class _Ggml:
    """ctypes bindings for the handful of ggml backend-registry functions llamaspec needs."""

    def __init__(self):
        lib = self._loaded_ggml()
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t

        def fn(name, restype, *argtypes):
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, list(argtypes)
            return f

        self.dev_count = fn("ggml_backend_dev_count", sz)
        self.dev_get = fn("ggml_backend_dev_get", vp, sz)
        self.dev_by_name = fn("ggml_backend_dev_by_name", vp, cp)
        self.dev_name = fn("ggml_backend_dev_name", cp, vp)
        self.dev_description = fn("ggml_backend_dev_description", cp, vp)
        self.dev_type = fn("ggml_backend_dev_type", ctypes.c_int, vp)
        self.dev_memory = fn("ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz))
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", vp, vp)
        self.reg_name = fn("ggml_backend_reg_name", cp, vp)
        self.reg_by_name = fn("ggml_backend_reg_by_name", vp, cp)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", vp, vp, cp)
        self.register = fn("ggml_backend_register", None, vp)

    @staticmethod
    def _loaded_ggml():
        """The libggml that libllama itself uses. A second copy (the same file under another path, e.g. through
        a build folder's RUNPATH) would have its own device registry, so ask the loader for the library already
        in the process by its soname first; only then look beside libllama."""
        no_load = getattr(os, "RTLD_NOLOAD", 0)
        for soname in ("libggml.so.0", "libggml.so", "libggml.0.dylib", "libggml.dylib"):
            if no_load:
                try:
                    return ctypes.CDLL(soname, mode=no_load | getattr(os, "RTLD_GLOBAL", 0))
                except OSError:
                    continue
        lib_dir = Path(llama_cpp.llama_cpp._base_path)
        names = sorted(lib_dir.glob("libggml.so*")) + sorted(lib_dir.glob("libggml*.dylib")) + \
            sorted(lib_dir.glob("ggml.dll"))
        if not names:
            raise ModelLoadError(f"cannot find llama.cpp's ggml library next to libllama in {lib_dir}")
        return ctypes.CDLL(str(names[0]))

    def device(self, ptr) -> Device:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(ptr, ctypes.byref(free), ctypes.byref(total))
        kind = self.dev_type(ptr)
        return Device(name=self.dev_name(ptr).decode(), description=(self.dev_description(ptr) or b"").decode(),
                      kind=_DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else str(kind),
                      backend=(self.reg_name(self.dev_backend_reg(ptr)) or b"").decode(),
                      free=free.value, total=total.value)


_GGML: list[_Ggml] = []


def _ggml() -> _Ggml:
    init_backend()
    if not _GGML:
        _GGML.append(_Ggml())
    return _GGML[0]


def devices() -> list[Device]:
    """Every device llama.cpp can place weights on, in registry order (RPC servers once added)."""
    g = _ggml()
    return [g.device(g.dev_get(i)) for i in range(g.dev_count())]


def supports_rpc() -> bool:
    return bool(llama_cpp.llama_supports_rpc()) if hasattr(llama_cpp, "llama_supports_rpc") else False


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ModelLoadError(f"RPC server {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def rpc_hello(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """Connect to a llama.cpp rpc-server and run its HELLO handshake; returns the server's protocol version.

    llama.cpp aborts the whole process when a server is unreachable or speaks another protocol, so every
    server is asked here first and a failure becomes one ModelLoadError."""
    import socket
    import struct

    host, port = _parse_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ModelLoadError(f"cannot reach the RPC server at {endpoint} ({exc.strerror or exc}); "
                             f"start it there with: rpc-server --host {host} --port {port}") from None
    body = b""
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", _RPC_HELLO, _RPC_CAPS_SIZE) + bytes(_RPC_CAPS_SIZE))
            head = _recv_exact(sock, 8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            body = _recv_exact(sock, size) if 3 <= size <= 4096 else b""
        except OSError:  # reset or timed out mid-handshake: not an rpc-server we can talk to
            pass
    if len(body) < 3:
        raise ModelLoadError(f"the RPC server at {endpoint} did not answer llama.cpp's RPC handshake: it is not an "
                             "rpc-server, or one built from a different llama.cpp version than this llama-cpp-python")
    major, minor, patch = body[0], body[1], body[2]
    return major, minor, patch


def _recv_exact(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def add_rpc_servers(servers: str | Sequence[str]) -> list[Device]:
    """Register llama.cpp RPC servers ("host:port,host:port") as devices; a model loaded afterwards with the
    default device list spreads over them (llama.cpp puts RPC devices first). Returns the servers' devices."""
    endpoints = [s.strip() for s in (servers.split(",") if isinstance(servers, str) else servers) if s.strip()]
    if not endpoints:
        raise ModelLoadError("no RPC servers given (expected host:port[,host:port...])")
    g = _ggml()
    reg = g.reg_by_name(b"RPC")
    add = g.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise ModelLoadError("this llama-cpp-python was built without llama.cpp's RPC backend; reinstall it with "
                             "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --force-reinstall --no-cache-dir "
                             "llama-cpp-python")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
    with _RPC_LOCK:
        for endpoint in endpoints:
            if endpoint in _RPC_ADDED:
                continue
            rpc_hello(endpoint)
            server_reg = add_server(endpoint.encode())
            if not server_reg:
                raise ModelLoadError(f"the RPC server at {endpoint} offers no devices")
            g.register(server_reg)
            _RPC_ADDED.add(endpoint)
    return [d for d in devices() if d.backend == "RPC" and d.description in endpoints]


def _device_list(names: Sequence[str]):
    """A NULL-terminated ggml_backend_dev_t array for llama_model_params.devices."""
    g = _ggml()
    ptrs = []
    for name in names:
        ptr = g.dev_by_name(name.encode())
        if not ptr:
            known = ", ".join(d.name for d in devices()) or "none"
            raise ModelLoadError(f"no device named {name!r} (devices: {known})")
        ptrs.append(ptr)
    return (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, None)

