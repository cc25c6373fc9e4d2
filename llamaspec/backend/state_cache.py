"""A host-memory cache of saved sequence states: a session whose slot another session took comes back to its own
state instead of processing its whole conversation again (llama-server's prompt cache, `--cache-ram`).

An entry is what one slot held: the tokens of its target sequence and, for each context that followed them (the
target's, a draft model's, an MTP head's), llama.cpp's serialisation of that sequence (`llama_state_seq_get_data_ext`
with no flags: its KV cells and its recurrent state) with the records that must agree with it (a recurrent state's
turn checkpoints, a drafter's bookkeeping): a `SavedSeq` each.

How far an entry serves a prompt (`Entry.reach`): on an attention-only memory, their common prefix (the restored
cache is then trimmed, as a slot's own is); on a recurrent or hybrid memory, which cannot be trimmed, the whole
entry when all its tokens begin the prompt, else its newest turn checkpoint within the common prefix.

The budget counts every byte an entry holds (states, turn checkpoints, a head's hidden states): the total never
exceeds it, the least recently stored entries go first to make room, and an entry larger than the budget is not
stored. A new entry replaces those it serves in full (their tokens begin its own), and one that an entry already
serves in full is not saved at all.

When a slot is saved and when an entry is restored is the targets' rule (targets.py); `wants` is its test. This
module knows which contexts the parts came from only through `read_seq` / `write_seq`.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from ..config import DEFAULT_CACHE_RAM
from .native import llama_cpp

MIB = 1 << 20
# A slot is saved only when it holds at least this many tokens and the next request keeps less than half of them
# (llama-server saves below half too, server-context.cpp get_available_slot); shorter states cost little to
# process again.
MIN_SAVED_TOKENS = 256


def common_prefix(a, b) -> int:
    """The length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


def read_seq(ptr, seq_id: int) -> np.ndarray | None:
    """llama.cpp's serialisation of sequence `seq_id` of the context `ptr` (KV cells and recurrent state), or None
    when it has nothing to write."""
    size = int(llama_cpp.llama_state_seq_get_size_ext(ptr, seq_id, 0))
    if size <= 0:
        return None
    data = np.empty(size, dtype=np.uint8)
    written = int(llama_cpp.llama_state_seq_get_data_ext(
        ptr, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq_id, 0))
    return data[:written] if written else None


def write_seq(ptr, seq_id: int, data: np.ndarray) -> bool:
    """Put a `read_seq` serialisation back into sequence `seq_id` (what it held is dropped first); False when
    llama.cpp read less than all of it (the sequence is then in no known state: clear it)."""
    read = int(llama_cpp.llama_state_seq_set_data_ext(
        ptr, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.size, seq_id, 0))
    return read == data.size


@dataclass
class SavedSeq:
    """One sequence of one context as it was saved: llama.cpp's bytes, the tokens the memory held, copies of its turn
    checkpoints (objects with `pos` and `data`) and a drafter's records (`extra`; numpy arrays there count)."""

    data: np.ndarray
    tokens: list[int]
    turns: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return (self.data.nbytes + sum(t.data.nbytes for t in self.turns)
                + sum(v.nbytes for v in self.extra.values() if isinstance(v, np.ndarray)))


@dataclass
class Entry:
    """A slot's saved state: `parts[0]` its target sequence, then its drafter's (None where it keeps none)."""

    tokens: list[int]
    marks: tuple[int, ...]   # turn checkpoints: positions a recurrent memory can restore to besides the end
    any_prefix: bool         # an attention-only memory: any prefix can be kept
    parts: list
    nbytes: int

    def reach(self, tokens) -> int:
        """How many of `tokens`' first tokens this entry can hold once restored."""
        common = common_prefix(self.tokens, tokens)
        if self.any_prefix or common == len(self.tokens):
            return common
        return max((m for m in self.marks if m <= common), default=0)


class StateCache:
    """Saved states within `budget_mib` MiB (-1: no limit, 0: none kept), oldest first."""

    def __init__(self, budget_mib: int = DEFAULT_CACHE_RAM, min_tokens: int = MIN_SAVED_TOKENS):
        self.budget = None if budget_mib < 0 else int(budget_mib) * MIB
        self.min_tokens = min_tokens
        self.entries: list[Entry] = []   # least recently stored first
        self.saves = self.restores = self.evictions = self.refusals = 0
        self.bytes_saved = self.bytes_restored = 0
        self.save_seconds = self.restore_seconds = 0.0
        self.tokens_restored = 0   # prompt tokens restored entries held for their requests

    @property
    def enabled(self) -> bool:
        return self.budget != 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def wants(self, held: int, kept: int) -> bool:
        """Whether a slot that holds `held` tokens, of which the next request keeps `kept`, is worth saving first."""
        return self.enabled and held >= self.min_tokens and kept * 2 < held

    def covers(self, tokens) -> bool:
        """Whether an entry already serves all of `tokens` (saving them again would add nothing)."""
        return any(e.reach(tokens) == len(tokens) for e in self.entries)

    def best(self, tokens) -> tuple[Entry | None, int]:
        """The entry that serves `tokens` furthest (the newest of equals) and how far; (None, 0) when none does."""
        best, reach = None, 0
        for entry in self.entries:
            n = entry.reach(tokens)
            if n > 0 and n >= reach:
                best, reach = entry, n
        return best, reach

    def put(self, tokens: list[int], parts: list, marks=(), any_prefix: bool = False, seconds: float = 0.0) -> bool:
        """Store a slot's parts (SavedSeq or None each) under the tokens its target held; False when it was refused
        (larger than the budget, or the cache is off)."""
        entry = Entry(list(tokens), tuple(sorted(marks)), any_prefix, parts,
                      sum(p.nbytes for p in parts if p is not None))
        self.save_seconds += seconds
        if not self.enabled or (self.budget is not None and entry.nbytes > self.budget):
            self.refusals += 1
            return False
        self.entries = [e for e in self.entries if entry.reach(e.tokens) < len(e.tokens)]   # those it serves go
        while self.budget is not None and self.entries and self.nbytes + entry.nbytes > self.budget:
            self.entries.pop(0)
            self.evictions += 1
        self.entries.append(entry)
        self.saves += 1
        self.bytes_saved += entry.nbytes
        return True

    def take(self, entry: Entry) -> Entry:
        """Remove `entry` for a restore: the slot holds its state from then on (and is saved again when another
        session takes it)."""
        self.entries.remove(entry)
        self.restores += 1
        self.bytes_restored += entry.nbytes
        return entry

    def clear(self) -> None:
        self.entries = []

