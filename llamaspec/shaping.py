"""Per-request changes to the target's next-token rows that stay exact under speculation: a grammar that masks
tokens (structured output, forced tool calls), llama.cpp's repetition penalties, and the log-probabilities
reported for each emitted token.

Why exact: everything that shapes row i of a verification is a function of the tokens before it, i.e. the history,
`last` and the draft tokens d_1..d_i. Shaping row i with that prefix gives the row plain decoding would have seen
had it emitted those tokens, so greedy acceptance keeps the same tokens and rejection sampling keeps the shaped
distribution. A draft token the grammar refuses ends the batch: it stays a draft token (rejection sampling must
see it drawn from q and rejected, or the residual would be wrong) but no row after it is decoded.

Log-probabilities are the target's own distribution (temperature 1, before penalties, grammar and filters, as
llama-server reports by default) at the row each token came from, draft or not: computed from the verified rows,
no extra pass. The engine calls this module only when a request asks for one of these; plain requests never pay.

Knows nothing about GBNF or llama.cpp: a grammar is any object with `clone()`, `allows(token)`, `accept(token)`
and `mask(row)` (backend/grammar.py makes them from GBNF).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import InvalidParameterError
from .sampling import Dist, SamplerConfig, filter_logits
from .verify import accept_rejection


# the smallest repeat penalty: a logit divided by less could overflow float32 to inf (1e-300 did), which no
# acceptance rule can use; llama.cpp's own range of use is about 1.0-1.5
REPEAT_PENALTY_MIN = 0.01


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's penalties sampler: over the last `last_n` tokens (prompt included, as llama-server does; -1:
    the whole context), a token seen c times gets its logit divided by `repeat` (multiplied when negative), then
    minus c * frequency + presence."""

    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int = 64

    def __post_init__(self):
        for name, value, lo, hi in (("repeat_penalty", self.repeat, REPEAT_PENALTY_MIN, 10.0),
                                    ("frequency_penalty", self.frequency, -2.0, 2.0),
                                    ("presence_penalty", self.presence, -2.0, 2.0)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or not lo <= value <= hi:
                raise InvalidParameterError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}", param=name)
        if not isinstance(self.last_n, int) or isinstance(self.last_n, bool) or self.last_n < -1:
            raise InvalidParameterError(f"repeat_last_n must be an integer >= -1, got {self.last_n!r}",
                                        param="repeat_last_n")

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self.repeat != 1.0 or self.frequency != 0.0 or self.presence != 0.0)

    def apply(self, row: np.ndarray, context: Sequence[int]) -> None:
        """Penalise `row` (in place) for the tokens in the window of `context`."""
        window = context if self.last_n < 0 else context[-self.last_n:]
        if not len(window):
            return
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        inside = ids < len(row)
        ids, counts = ids[inside], counts[inside]
        values = row[ids]
        values = np.where(values > 0, values / self.repeat, values * self.repeat)
        row[ids] = values - counts * self.frequency - self.presence


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]   # the n most likely tokens of the row, best first (n = top_logprobs)


@dataclass
class Shaping:
    """What a request asks of the target's rows. `grammar`: its state at the start of the reply. `top_logprobs`:
    None for no log-probabilities, n >= 0 for the emitted token's and the n best of each row; they land in
    `logprobs`, one per emitted token (the end-of-generation token included when it ends the reply)."""

    grammar: object | None = None
    penalties: Penalties | None = None
    top_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.grammar is not None or (self.penalties is not None and self.penalties.active) \
            or self.top_logprobs is not None or bool(self.logit_bias)

    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.fromiter(self.logit_bias, np.int64), np.fromiter(self.logit_bias.values(), np.float32)


class ShapedRows:
    """One verification's target rows, shaped lazily (rows past the first rejection are never touched).

    `raw` are the target's logits for the batch [last, d_1..d_m] (views into llama.cpp's buffer: read only);
    `context` the committed history; `states[i]` the grammar after d_1..d_i."""

    def __init__(self, shaping: Shaping, raw: np.ndarray, context: list[int], batch: list[int], states: list,
                 scratch: np.ndarray):
        self.shaping, self.raw, self.context, self.batch, self.states = shaping, raw, context, batch, states
        self.scratch = scratch
        self._rows: dict[int, np.ndarray] = {}

    def row(self, i: int) -> np.ndarray:
        """Row i with penalties and the grammar's mask (-inf outside it)."""
        if i not in self._rows:
            row = self._penalised(i)
            if self.states:
                self.states[i].mask(row)
            self._rows[i] = row
        return self._rows[i]

    def _penalised(self, i: int) -> np.ndarray:
        row = self.scratch[i]
        row[:] = self.raw[i]
        penalties = self.shaping.penalties
        if penalties is not None and penalties.active:
            penalties.apply(row, self.context + self.batch[:i + 1])
        if self.shaping.logit_bias:
            ids, bias = self.shaping.bias_arrays()
            row[ids] += bias
        return row

    def greedy(self, i: int) -> int:
        """The argmax of the shaped row; the grammar is asked about the unmasked argmax first (one token), and masks
        the whole row only when it refuses that token."""
        if self.states and i not in self._rows:
            token = int(self._penalised(i).argmax())
            if self.states[i].allows(token):
                return token
        row = self.row(i)
        token = int(row.argmax())
        if not np.isfinite(row[token]):
            raise InvalidParameterError("the grammar allows no token at this point of the reply", param="grammar")
        return token

    def dist(self, cfg: SamplerConfig, i: int) -> Dist:
        row = self.row(i)
        if not np.isfinite(row.max()):
            raise InvalidParameterError("the grammar allows no token at this point of the reply", param="grammar")
        return filter_logits(row, cfg)


class Shaper:
    """A request's shaping across its steps: the grammar's state at the end of the committed tokens, the scratch
    rows, and the log-probabilities so far."""

    def __init__(self, shaping: Shaping, n_vocab: int):
        self.shaping, self.n_vocab = shaping, n_vocab
        self.grammar = shaping.grammar
        self._scratch = np.zeros((0, n_vocab), np.float32)
        self._states: list = []

    def admissible(self, drafted: list[int]) -> int:
        """How many leading draft tokens the grammar allows (all of them without a grammar); remembers the grammar's
        state after each, for the rows."""
        if self.grammar is None:
            self._states = []
            return len(drafted)
        state, self._states = self.grammar, [self.grammar]
        for i, token in enumerate(drafted):
            if not state.allows(token):
                return i
            state = state.clone()
            state.accept(token)
            self._states.append(state)
        return len(drafted)

    def rows(self, raw: np.ndarray, context: list[int], batch: list[int]) -> ShapedRows:
        if self._scratch.shape[0] < len(batch):
            self._scratch = np.zeros((max(len(batch), 8), self.n_vocab), np.float32)
        return ShapedRows(self.shaping, raw, context, batch, self._states, self._scratch)

    def accept(self, rows: ShapedRows, draft: np.ndarray, draft_probs, sampling) -> tuple[int, int]:
        """The acceptance rule over shaped rows: greedy (sampling None) keeps draft tokens while they are the shaped
        argmax; otherwise Leviathan/Chen rejection sampling against the shaped, filtered rows."""
        if sampling is None:
            n = 0
            while n < len(draft) and rows.greedy(n) == draft[n]:
                n += 1
            return n, rows.greedy(n)
        return accept_rejection(draft, draft_probs, lambda i: rows.dist(sampling.config, i), sampling.rng)

    def commit(self, rows: ShapedRows, n_accepted: int, next_token: int, is_eog) -> None:
        """The step kept d_1..d_n and emitted `next_token`: advance the grammar, record log-probabilities."""
        if self.grammar is not None:
            state = self._states[n_accepted]
            if not is_eog(next_token):
                state = state.clone()
                state.accept(next_token)
            self.grammar, self._states = state, []
        n = self.shaping.top_logprobs
        if n is not None:
            emitted = rows.batch[1:1 + n_accepted] + [next_token]
            for i, token in enumerate(emitted):
                self.shaping.logprobs.append(token_logprob(rows.raw[i], token, n))
                if is_eog(token):   # an accepted end-of-generation draft token ends the reply
                    break


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """log softmax(logits)[token] and the n_top best (one exp pass over the row; argpartition for the best)."""
    best = float(logits.max())
    log_z = best + math.log(float(np.exp(logits - best).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if n_top > 0:
        n_top = min(n_top, len(logits))
        ids = np.argpartition(logits, len(logits) - n_top)[len(logits) - n_top:]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        top = [(int(t), float(logits[t]) - log_z) for t in ids]
    return TokenLogprob(int(token), float(logits[token]) - log_z, top)
