"""llama.cpp's grammar sampler as the grammar that shaping.py asks for: GBNF in, a state that can be cloned, asked
about one token, advanced by one token, and asked to mask a whole logits row.

JSON schemas become GBNF through llama-cpp-python's port of llama.cpp's own converter (json_schema_to_gbnf), so a
`response_format` schema constrains the same way as llama-server's `json_schema`. Knows nothing about requests or
speculation.
"""
from __future__ import annotations

import ctypes
import json

import numpy as np

from ..errors import InvalidParameterError
from .native import NativeHandle, llama_cpp, native_log

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])   # llama_token_data
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

# any JSON object (OpenAI's json_object mode): llama.cpp's json.gbnf, whose root is an object
JSON_OBJECT_GBNF = __import__("llama_cpp.llama_grammar", fromlist=["JSON_GBNF"]).JSON_GBNF


class _Candidates:
    """A reusable llama_token_data_array over n token ids (the grammar writes -inf into the logits it refuses)."""

    def __init__(self, n: int):
        self.data = np.zeros(n, dtype=_TOKEN_DATA)
        self.array = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=n, selected=-1,
            sorted=False)
        self.ref = ctypes.byref(self.array)


class Grammar(NativeHandle):
    """One state of a llama.cpp grammar sampler over a model's vocabulary."""

    def __init__(self, handle, n_vocab: int, shared: dict):
        self._ptr, self.n_vocab, self._shared = handle, n_vocab, shared

    @classmethod
    def compile(cls, model, gbnf: str, param: str = "grammar", root: str = "root") -> "Grammar":
        """A grammar from GBNF text; one clear error naming `param` when llama.cpp cannot parse it."""
        if not isinstance(gbnf, str) or not gbnf.strip():
            raise InvalidParameterError(f"'{param}' must be non-empty GBNF text", param=param)
        with native_log() as lines:
            handle = llama_cpp.llama_sampler_init_grammar(model.vocab, gbnf.encode("utf-8"), root.encode())
        if not handle:
            detail = " ".join(" ".join(lines).split())[:200] or "no details from llama.cpp"
            raise InvalidParameterError(f"'{param}' is not a grammar llama.cpp accepts ({detail})", param=param)
        one = _Candidates(1)
        return cls(handle, model.n_vocab, {"one": one, "all": None})

    def clone(self) -> "Grammar":
        return Grammar(llama_cpp.llama_sampler_clone(self._ptr), self.n_vocab, self._shared)

    def allows(self, token: int) -> bool:
        one = self._shared["one"]
        one.data[0] = (token, 0.0, 0.0)
        one.array.size, one.array.selected = 1, -1
        llama_cpp.llama_sampler_apply(self._ptr, one.ref)
        return bool(np.isfinite(one.data["logit"][0]))

    def accept(self, token: int) -> None:
        """Advance by `token`, which the caller has checked with `allows` (llama.cpp aborts on a refused one)."""
        llama_cpp.llama_sampler_accept(self._ptr, int(token))

    def mask(self, row: np.ndarray) -> None:
        """Set the logits of every token the grammar refuses here to -inf (in place; ids past n_vocab too)."""
        cand = self._shared["all"]
        if cand is None:
            cand = self._shared["all"] = _Candidates(self.n_vocab)
            cand.data["id"] = np.arange(self.n_vocab, dtype=np.int32)
        cand.data["logit"] = 0.0
        cand.array.size, cand.array.selected, cand.array.sorted = self.n_vocab, -1, False
        llama_cpp.llama_sampler_apply(self._ptr, cand.ref)
        row[:self.n_vocab][np.isneginf(cand.data["logit"])] = -np.inf
        row[self.n_vocab:] = -np.inf

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_sampler_free(self._ptr)
            self._ptr = None


def json_schema_gbnf(schema, param: str = "response_format") -> str:
    """GBNF for the JSON values a schema accepts; an InvalidParameterError naming `param` for what the converter
    cannot translate."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except RecursionError:
        raise InvalidParameterError(f"'{param}': the JSON schema is nested too deeply", param=param) from None
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions of several kinds
        raise InvalidParameterError(f"'{param}': this JSON schema cannot be turned into a grammar "
                                    f"({type(e).__name__}: {str(e)[:160]})", param=param) from None
