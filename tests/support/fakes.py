"""A fake backend: models whose logits are a deterministic function of the token sequence, and contexts that record
every decode, so the engine's bookkeeping (positions, rollback, no re-decoding) can be checked without llama.cpp."""
from __future__ import annotations

import numpy as np

from llamaspec.drafters import make_drafter
from llamaspec.engine import Pair


class FakeModel:
    """Next-token logits depend on the last two tokens: a peaked 'true' token plus a little noise.

    `disagree` (0..1) is how often the draft version puts its peak elsewhere (decided per context, deterministically).
    """

    is_recurrent = is_hybrid = False   # an attention cache: any tail can be dropped

    def __init__(self, n_vocab: int = 64, eog: int = 1, disagree: float = 0.0, salt: int = 0, sharpness: float = 8.0):
        self.n_vocab, self.eog, self.disagree, self.salt, self.sharpness = n_vocab, eog, disagree, salt, sharpness
        self.path = type("P", (), {"name": "fake.gguf"})()

    def true_next(self, tokens) -> int:
        a, b = (tokens[-2] if len(tokens) > 1 else 0), tokens[-1]
        return (a * 7 + b * 13 + 5) % (self.n_vocab - 2) + 2  # never 0 or 1 (1 is the end-of-generation token)

    def logits(self, tokens) -> np.ndarray:
        rng = np.random.default_rng(hash((tuple(tokens[-2:]), len(tokens) % 5)) % (2**32))
        row = rng.standard_normal(self.n_vocab).astype(np.float32)
        peak = self.true_next(tokens)
        if self.disagree and (hash((tuple(tokens[-2:]), self.salt)) % 1000) / 1000 < self.disagree:
            peak = (peak + 1 + self.salt) % (self.n_vocab - 2) + 2
        row[peak] += self.sharpness
        return row

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def tokenize(self, text, add_special=True, parse_special=True):
        return [2 + (ord(c) % (self.n_vocab - 2)) for c in text]

    def detokenize(self, tokens):
        return "".join(f"<{t}>" for t in tokens)

    def close(self):
        pass


class FakeContext:
    def __init__(self, model: FakeModel, n_ctx: int = 256, n_batch: int = 64):
        self.model, self.n_ctx, self.n_batch, self.n_vocab = model, n_ctx, n_batch, model.n_vocab
        self.tokens: list[int] = []
        self.decoded: list[int] = []      # every token ever decoded, in order
        self.evals: list[int] = []        # batch sizes
        self.decode_seconds = 0.0
        self.rollback_seconds = 0.0       # an attention cache: keep() is free, nothing is replayed
        self.replayed_tokens = 0
        self.checkpoints: list[tuple[int, bool]] = []  # (position, turn) of every checkpoint() call
        self._out = None
        self.device_argmax_ok = True      # what set_device_argmax(True) achieves (a build without it: False)
        self.device_argmax = False

    @property
    def n_past(self):
        return len(self.tokens)

    @property
    def n_in_memory(self):
        return len(self.tokens)

    def checkpoint(self, turn=False):
        self.checkpoints.append((self.n_past, turn))

    def eval(self, tokens, logits="last"):
        tokens = [int(t) for t in tokens]
        assert tokens, "empty eval"
        assert self.n_past + len(tokens) <= self.n_ctx, "context overflow not prevented by the engine"
        rows = []
        for i, t in enumerate(tokens):
            self.tokens.append(t)
            if logits == "all" or (logits == "last" and i == len(tokens) - 1):
                rows.append(self.model.logits(self.tokens))
        self.decoded.extend(tokens)
        self.evals.append(len(tokens))
        self.decode_seconds += 1e-4 * len(tokens)
        if logits == "none":
            return None
        self._out = np.stack(rows)
        return self._out

    def eval_argmax(self, tokens, rows="last"):
        return self.eval(tokens, logits=rows).argmax(axis=1).tolist()

    def set_device_argmax(self, on):
        self.device_argmax = bool(on) and self.device_argmax_ok
        return self.device_argmax

    prefers_device_sampling = False   # the numpy filters (a FakeDeviceContext filters "on the device")

    def set_device_sampler(self, cfg, seed=0):
        return False

    def keep(self, n):
        del self.tokens[n:]
        return True

    def reach(self, n):
        return min(n, self.n_past)

    def save_state(self, **extra):
        """A fake state: its tokens are all there is (FakeModel's logits depend on the tokens only)."""
        from llamaspec.backend.state_cache import SavedSeq

        return SavedSeq(np.asarray(self.tokens, dtype=np.int64).view(np.uint8), list(self.tokens), [], extra) \
            if self.tokens else None

    def restore_state(self, saved):
        self.tokens[:] = saved.tokens
        return True

    def resync(self):
        pass

    def clear(self):
        self.tokens.clear()

    def close(self):
        pass


class FakeDeviceContext(FakeContext):
    """A FakeContext that "filters on the device": eval_dists applies the reference rule (filtered_probs) to each
    row and draws from it with its own random stream, the way llama.cpp's sampler chain does."""

    prefers_device_sampling = True

    def __init__(self, model: FakeModel, n_ctx: int = 256, can_sample: bool = True):
        super().__init__(model, n_ctx)
        self.can_sample = can_sample
        self.sampler = None           # the SamplerConfig attached
        self.dist_evals = 0

    def set_device_sampler(self, cfg, seed=0):
        self.sampler = cfg if cfg is not None and self.can_sample else None
        self._draws = np.random.default_rng(seed)
        return self.sampler is not None

    def eval(self, tokens, logits="last"):
        if logits != "none":
            self.sampler = None       # as llama.cpp's: a logits eval detaches the chain
        return super().eval(tokens, logits)

    def eval_dists(self, tokens, rows="last"):
        from llamaspec.sampling import Dist, filtered_probs

        assert self.sampler is not None, "eval_dists without a device sampler"
        cfg = self.sampler
        out = []
        for row in super().eval(tokens, logits=rows):
            p = filtered_probs(row, cfg)
            ids = np.flatnonzero(p)
            out.append(Dist(ids, p[ids], 1.0, draw=int(self._draws.choice(ids, p=p[ids] / p[ids].sum()))))
        self.dist_evals += 1
        return out


def fake_device_pair(disagree: float = 0.0, policy=None, n_ctx: int = 256, draft_can_sample: bool = True,
                     **kw) -> Pair:
    target = FakeModel(**kw)
    draft = FakeModel(disagree=disagree, salt=3, **kw)
    drafter = make_drafter("model", target, FakeDeviceContext(draft, n_ctx, can_sample=draft_can_sample))
    return Pair(target, FakeDeviceContext(target, n_ctx), drafter, policy)


def fake_pair(disagree: float = 0.0, policy=None, n_ctx: int = 256, drafter: str = "model", **kw) -> Pair:
    target = FakeModel(**kw)
    draft = FakeModel(disagree=disagree, salt=3, **kw)
    return Pair(target, FakeContext(target, n_ctx), make_drafter(drafter, target, FakeContext(draft, n_ctx)), policy)


def plain_pair(n_ctx: int = 256, **kw) -> Pair:
    target = FakeModel(**kw)
    return Pair(target, FakeContext(target, n_ctx))
