"""llama.cpp's grammar sampler as the grammar that shaping.py asks for: GBNF in, a state that can be cloned, asked
about one token, advanced by one token, and asked to mask a whole logits row.

JSON schemas become GBNF through llama-cpp-python's port of llama.cpp's own converter (json_schema_to_gbnf), so a
`response_format` schema constrains the same way as llama-server's `json_schema`. Knows nothing about requests or
speculation.
"""
from __future__ import annotations

import ctypes
import json
import re
import time
import weakref

import numpy as np

from ..errors import InvalidParameterError
from .native import NativeHandle, llama_cpp, native_log

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])   # llama_token_data
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

# any JSON object (OpenAI's json_object mode): llama.cpp's json.gbnf, whose root is an object
JSON_OBJECT_GBNF = __import__("llama_cpp.llama_grammar", fromlist=["JSON_GBNF"]).JSON_GBNF


# The most one row's mask may cost. llama.cpp checks a token against every parse of the grammar that its bytes
# follow, and an ambiguous grammar has exponentially many (N segments of [a-z]*), all inside one call that cannot
# be stopped. JSON and tool-call grammars mask a row in milliseconds, the ambiguous ones in seconds to minutes
# (benchmarks/results/grammar-cost-bound.md): a grammar past this budget is refused rather than waited for.
MASK_BUDGET_S = 0.5
TRIAL_STEPS = 2             # states beyond the start that a new grammar is tried on
_CHUNK = 2048               # tokens per llama.cpp call at most: between two calls the budget is checked
_FIRST_CHUNK = 4            # the first, before anything is known of the cost
_NOISE_S = 1e-6             # a token's check below this (~0.1 us for JSON grammars) is noise, not a trend
_PARSE_S = 1e-5            # a token's check per parse it follows, at most (1000 parses: ~10 ms a token)
_EXTRAPOLATE_BYTES = 4      # the next chunk's cost is predicted at most this many bytes further


class GrammarCostError(InvalidParameterError):
    """A grammar whose mask costs more than the budget: too ambiguous for llama.cpp's grammar engine."""


# GBNF text (a converted JSON schema's too): JSON and tool-call grammars are a few kB; llama.cpp prints a grammar it
# cannot parse to stderr in full
GRAMMAR_MAX_CHARS = 128 * 1024
# a repetition count (x{n}, x{m,n}; minLength, maxItems, ...): llama-cpp-python's schema converter writes each
# repetition out before llama.cpp sees it (minLength 100000000: tens of seconds and gigabytes); llama.cpp's own
# parser refuses counts past 2000 (MAX_REPETITION_THRESHOLD), so the converter gets the same limit, and all the
# counts of one schema together at most REPEAT_TOTAL_MAX (its output stays within GRAMMAR_MAX_CHARS' order)
REPEAT_MAX = 2000
REPEAT_TOTAL_MAX = 20000
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# optional items (x*, x?, x{0,n}) in a row: every one a place where a parse may stand, and llama.cpp checks a
# token against each parse, each copied whole, so the cost of one token grows as the cube of the run; JSON and
# tool-call grammars have runs of 1 or 2
OPTIONAL_RUN_MAX = 100
_GBNF_TOKEN = re.compile(r'#[^\n]*|"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|::=|[A-Za-z0-9_-]+|\{[^}]*\}|\S')
_ZERO_MIN = re.compile(r"\{\s*0\s*[,}]")
_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")


def _check_repetitions(text: str, param: str, what: str) -> int:
    """The sum of the repetition counts in `text`; an error naming `param` for one beyond REPEAT_MAX."""
    total = 0
    for found in _REPEAT.finditer(text):
        count = max(int(n) for n in found.groups() if n)
        if count > REPEAT_MAX:
            raise InvalidParameterError(f"'{param}': {what} repeats something {count} times ({found.group()[:40]}); "
                                        f"at most {REPEAT_MAX} are accepted", param=param)
        total += count
    return total


def optional_run(gbnf: str) -> int:
    """The most optional items in a row in any sequence of the grammar (a group counts as one item)."""
    tokens = [t for t in _GBNF_TOKEN.findall(gbnf) if not t.startswith("#")]
    runs, longest = [0], 0
    for i, token in enumerate(tokens):
        if token == "(":
            runs.append(0)
        elif token in ("|", "::="):
            runs[-1] = 0
        elif token not in ("*", "+", "?") and not token.startswith("{"):
            if token == ")" and len(runs) > 1:
                runs.pop()
            after = tokens[i + 1] if i + 1 < len(tokens) else ""
            runs[-1] = runs[-1] + 1 if after in ("*", "?") or _ZERO_MIN.match(after) else 0
            longest = max(longest, runs[-1])
    return longest


def _check_schema_counts(schema, param: str) -> None:
    """Refuse counts (minLength, maxItems, a pattern's a{n}) beyond REPEAT_MAX anywhere in a schema, or beyond
    REPEAT_TOTAL_MAX all together."""
    stack, total = [schema], 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key in _SCHEMA_COUNTS:
                count = item.get(key)
                if isinstance(count, (int, float)) and not isinstance(count, bool) and count > 0:
                    if count > REPEAT_MAX:
                        raise InvalidParameterError(f"'{param}': the JSON schema's {key} is {count}; at most "
                                                    f"{REPEAT_MAX} is accepted", param=param)
                    total += count
            if isinstance(item.get("pattern"), str):
                total += _check_repetitions(item["pattern"], param, "the JSON schema's pattern")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    if total > REPEAT_TOTAL_MAX:
        raise InvalidParameterError(f"'{param}': the JSON schema's counts (minLength, maxItems, a pattern's {{n}}, "
                                    f"...) add up to {total:g}; at most {REPEAT_TOTAL_MAX} are accepted", param=param)


_by_length: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ids_by_length(model) -> tuple[np.ndarray, np.ndarray]:
    """The vocabulary's token ids, shortest piece first, and each one's piece length in bytes (once per model):
    a token's check costs about (parses per byte) ** its length, so masking in this order lets the cost of the
    longer ones be predicted from the shorter ones before they are tried."""
    found = _by_length.get(model)
    if found is None:
        buf = ctypes.create_string_buffer(512)
        lengths = np.fromiter((abs(llama_cpp.llama_token_to_piece(model.vocab, t, buf, len(buf), 0, False))
                               for t in range(model.n_vocab)), np.int32, model.n_vocab)
        order = np.argsort(lengths, kind="stable").astype(np.int32)
        found = _by_length[model] = (order, lengths[order])
    return found


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
        if len(gbnf) > GRAMMAR_MAX_CHARS:
            raise InvalidParameterError(f"'{param}': the grammar is {len(gbnf)} characters long; at most "
                                        f"{GRAMMAR_MAX_CHARS} are accepted", param=param)
        outside_literals = re.sub(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', " ", gbnf)
        _check_repetitions(outside_literals, param, "the grammar")
        if (run := optional_run(gbnf)) > OPTIONAL_RUN_MAX:
            raise GrammarCostError(f"'{param}' has {run} optional items (x*, x?) in a row; at most {OPTIONAL_RUN_MAX} "
                                   "are accepted (llama.cpp's cost grows with the cube of that)", param=param)
        with native_log() as lines:
            handle = llama_cpp.llama_sampler_init_grammar(model.vocab, gbnf.encode("utf-8"), root.encode())
        if not handle:
            detail = " ".join(" ".join(lines).split())[:200] or "no details from llama.cpp"
            raise InvalidParameterError(f"'{param}' is not a grammar llama.cpp accepts ({detail})", param=param)
        one = _Candidates(1)
        order, lengths = _ids_by_length(model)
        grammar = cls(handle, model.n_vocab, {"one": one, "all": None, "order": order, "lengths": lengths,
                                              "param": param})
        grammar._trial(model)
        return grammar

    def _trial(self, model) -> None:
        """Mask the start state and the states after the shortest allowed token, TRIAL_STEPS deep (about 10 ms
        each for JSON grammars): a grammar too costly there (behind an opening quote, say) is refused before any
        reply begins. An ambiguity further in is met by each row's own budget, mid-reply."""
        state, row, order = self.clone(), np.zeros(self.n_vocab, np.float32), self._shared["order"]
        try:
            for step in range(TRIAL_STEPS + 1):
                row[:] = 0.0
                state.mask(row)
                allowed = order[np.isfinite(row[order])]
                going_on = next((int(t) for t in allowed if not model.is_eog(int(t))), None)
                if going_on is None or step == TRIAL_STEPS:
                    return
                state.accept(going_on)
        finally:
            state.close()

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

    def mask(self, row: np.ndarray, budget: float = MASK_BUDGET_S) -> None:
        """Set the logits of every token the grammar refuses here to -inf (in place; ids past n_vocab too). Tokens
        go to llama.cpp shortest first, a chunk per call, each chunk sized from the cost of the last (times its
        growth per byte) to a quarter of the budget left; GrammarCostError once the row has cost more than
        `budget` seconds. A stall of the process only makes the next chunk small."""
        shared = self._shared
        cand, order, lengths = shared["all"], shared["order"], shared["lengths"]
        if cand is None:
            cand = shared["all"] = _Candidates(self.n_vocab)
            cand.data["id"] = order
        cand.data["logit"] = 0.0
        part = llama_cpp.llama_token_data_array()
        part_ref = ctypes.byref(part)
        item = ctypes.sizeof(llama_cpp.llama_token_data)
        base = cand.data.ctypes.data
        start_time = time.perf_counter()
        last, worst, longest = 0.0, 0.0, 0   # the last chunk's cost per token (s), the costliest, longest piece
        start, size = 0, _FIRST_CHUNK
        while start < self.n_vocab:
            end = min(start + size, self.n_vocab)
            part.data = ctypes.cast(base + start * item, ctypes.POINTER(llama_cpp.llama_token_data))
            part.size, part.selected, part.sorted = end - start, -1, False
            t0 = time.perf_counter()
            llama_cpp.llama_sampler_apply(self._ptr, part_ref)
            cost = (time.perf_counter() - t0) / (end - start)
            # growth per byte: as measured from the chunk before when both stand above the noise, and at least
            # the parses this cost stands for (each byte more may follow every one of them)
            growth = max(cost / _PARSE_S, 1.0)
            if min(cost, last) > _NOISE_S and int(lengths[end - 1]) > longest:
                growth = max(growth, (cost / last) ** (1 / (int(lengths[end - 1]) - longest)))
            last, worst, longest, start = cost, max(worst, cost), int(lengths[end - 1]), end
            spent = time.perf_counter() - start_time
            if spent > budget and start < self.n_vocab:
                raise GrammarCostError(
                    f"'{shared['param']}' is too ambiguous for llama.cpp's grammar engine: masking one row costs "
                    f"more than {budget:g} s (a token of {longest} bytes took {worst * 1e6:.0f} us); make repeated "
                    "parts unambiguous (a literal between them) or shorten it", param=shared["param"])
            # the next chunk: about a quarter of what is left of the budget, at the cost predicted for its pieces
            ahead = last * growth ** min(int(lengths[min(start + _CHUNK, self.n_vocab) - 1]) - longest,
                                         _EXTRAPOLATE_BYTES)
            size = int(min(max((budget - spent) / 4 / max(ahead, 1e-9), 1), _CHUNK))
        row[order[np.isneginf(cand.data["logit"])]] = -np.inf
        row[self.n_vocab:] = -np.inf

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_sampler_free(self._ptr)
            self._ptr = None


def json_schema_gbnf(schema, param: str = "response_format") -> str:
    """GBNF for the JSON values a schema accepts; an InvalidParameterError naming `param` for what the converter
    cannot translate."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    _check_schema_counts(schema, param)
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except RecursionError:
        raise InvalidParameterError(f"'{param}': the JSON schema is nested too deeply", param=param) from None
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions of several kinds
        raise InvalidParameterError(f"'{param}': this JSON schema cannot be turned into a grammar "
                                    f"({type(e).__name__}: {str(e)[:160]})", param=param) from None
