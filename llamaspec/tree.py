"""Tree verification: where the draft is unsure, a sibling candidate is verified beside the chain in the same pass.

The tree is the chain d_1..d_k with at most `max_siblings` leaves: at a position i where the draft model's top
probability is below `threshold`, a second candidate s_i (greedy: its second-best token; sampling: a second
independent draw from the same q_i) sits beside d_i, in its own llama.cpp sequence that shares the prefix
(backend/tree.py). A sibling is added only where the measured costs say it pays (`sibling_pays`): the extra row
must cost less than the token it is expected to bring.

Acceptance keeps the target's output exactly:
- greedy: d_i stands while it is the target's argmax; at the first mismatch, s_i stands if it is the argmax, and
  the target's argmax after s_i follows it. Every emitted token is an argmax: the output of plain decoding.
- sampling: recursive rejection over the children of a node (SpecInfer, Miao et al. 2023; SpecTr's k-sequential
  rule, Sun et al. 2023): d_i stands with probability min(1, p(d_i) / q(d_i)); otherwise r = norm(max(0, p - q)) and
  s_i stands with probability min(1, r(s_i) / q(s_i)); otherwise the token is drawn from norm(max(0, r - q)). With
  d_i and s_i independent draws from q, the emitted token has exactly the distribution p. A sibling equal to d_i takes
  no row (after d_i's rejection r(d_i) = 0: it cannot stand) but still counts as a rejected round: the next draw is
  from norm(max(0, r - q)), not from r. Whether a node gets a sibling may depend on anything but the sibling's own
  value (its expected worth is read from q, not from s).

Who can use it: a draft model drafter (kind "model") over an attention target. Drafters that follow the target's
decodes (MTP, EAGLE-3, DFlash) would read a sibling's features as the chain's; a recurrent or hybrid target would
need one recurrent state per branch (n_seq copies of it, and a state copy per accepted sibling): both are refused.
Off by default: `enable_tree(pair, ...)` turns it on (benchmarks/compare/bench_engine.py --tree measures it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import modes
from .drafters.base import Drafter
from .errors import InvalidParameterError
from .sampling import as_dist, filter_logits, max_prob, sample
from .verify import accept_greedy, residual


@dataclass(frozen=True)
class TreeSettings:
    threshold: float = 0.5   # a sibling where the draft's top probability is below this
    max_siblings: int = 2    # leaves per pass (each one more llama.cpp sequence)


# -- the acceptance rules (pure) -------------------------------------------------------------------------------
def accept_greedy_tree(chain: np.ndarray, siblings: dict[int, int], argmax: np.ndarray) -> tuple[int, int, bool]:
    """chain (k,), siblings {i: s_i}, argmax: the target's argmax of the chain rows (k + 1,). Returns (n accepted from
    the chain, the token after them, whether that token is the sibling s_n)."""
    n, token = accept_greedy(chain, argmax)
    return (n, token, True) if n < len(chain) and siblings.get(n) == token else (n, token, False)


def accept_rejection_tree(chain: np.ndarray, chain_q, siblings: dict[int, int], target_probs, rng):
    """Leviathan/Chen's rule along the chain with, at a rejection where a sibling stands beside d_i, one more
    round of the recursive rule (the residual as target). chain_q[i]: the q both d_i and s_i were drawn from;
    target_probs(i): the target's row i. Returns (n accepted from the chain, next token, took_sibling)."""
    k = len(chain)
    for i in range(k):
        x = int(chain[i])
        p, q = as_dist(target_probs(i)), as_dist(chain_q[i])
        if rng.random() * q.prob(x) < p.prob(x):   # accept with probability min(1, p(x) / q(x))
            continue
        r = residual(p, q)
        s = siblings.get(i)
        if s is not None:   # s == x: rejected for sure (r(x) = 0 once x was), still a round of the rule
            if s != x and rng.random() * q.prob(s) < r.prob(s):   # min(1, r(s) / q(s))
                return i, s, True
            r = residual(r, q)
        return i, sample(r, rng), False
    return k, sample(as_dist(target_probs(k)), rng), False


def sibling_pays(gain_tokens: float, extra_seconds: float, seconds_per_token: float) -> bool:
    """A sibling brings one token with probability `gain_tokens` (the chance the path reaches it and it stands) and
    costs `extra_seconds` of target time (its row in the pass): it pays when gain * seconds per token > cost."""
    return gain_tokens * seconds_per_token > extra_seconds


# -- drafting the siblings --------------------------------------------------------------------------------------
class TreeDrafter(Drafter):
    """A draft model drafter that also proposes siblings (`siblings`: {i: s_i, q top probability} of the last
    proposal); `accepted` tells the draft model only the chain tokens that stood (a sibling is caught up on)."""

    def __init__(self, inner, settings: TreeSettings, rng_seed: int = 0):
        self.inner, self.settings = inner, settings
        self.kind, self.contexts = inner.kind, inner.contexts
        self.siblings: dict[int, tuple[int, float]] = {}
        self.took_sibling = False
        self.unsure = 0      # drafted positions whose top probability was below the threshold (a sibling offered)
        self._sampling = None
        self._prefix = 1.0   # the draft's chance that the chain so far stands (product of top probabilities)
        self._scratch = np.empty(inner.ctx.n_vocab, dtype=np.float32)
        inner.branch = self._branch

    @property
    def draft_cost(self) -> str:
        return self.inner.draft_cost

    def begin(self, history, sampling, p_min, prefill) -> None:
        self._sampling = sampling
        self.inner.begin(history, sampling, p_min, prefill)
        self.inner.ctx.set_device_argmax(False)   # the rows' top two are read in numpy

    def propose(self, history, last, max_len, p_min):
        self.siblings, self._prefix, self.took_sibling = {}, 1.0, False
        return self.inner.propose(history, last, max_len, p_min)

    def _branch(self, i: int, logits: np.ndarray, q, token: int) -> None:
        if q is None:   # greedy: the second-best token
            top = max_prob(logits, self._scratch, logits[token])
            if top < self.settings.threshold:
                two = np.argpartition(logits, -2)[-2:]
                second = int(two[0] if int(two[1]) == token else two[1])
                self._add(i, second, float(np.exp(logits[second] - logits[token])) * top, top)
        else:           # sampling: a second, independent draw from q
            top = q.max_prob()
            if top < self.settings.threshold:
                s = sample(q, self._sampling.rng)   # kept when equal to `token` too (see the module docstring)
                self._add(i, s, top * (1.0 - top), top)   # its worth may not depend on s itself
        self._prefix *= top if q is None else q.prob(token)

    def _add(self, i: int, token: int, q_s: float, top: float) -> None:
        self.unsure += 1
        if token < self.inner.n_vocab_target:
            self.siblings[i] = (token, self._prefix * q_s)   # the chance it is reached and stands, as q sees it

    def accepted(self, n_accepted: int) -> None:
        self.inner.accepted(n_accepted - 1 if self.took_sibling else n_accepted)

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


# -- verification ----------------------------------------------------------------------------------------------
class TreeVerifier:
    """The verification while a tree is on (the pair's verifier seam, enable_tree): a tree pass where siblings pay, the request's chain path else."""

    def __init__(self, drafter: TreeDrafter, settings: TreeSettings, costs):
        self.drafter, self.settings, self.costs = drafter, settings, costs
        self.passes = self.tree_passes = self.siblings_taken = 0

    def chosen_siblings(self, n_chain: int) -> list[tuple[int, int]]:
        """(i, s_i) of the siblings that pay at a chain pass of n_chain rows, the likeliest first."""
        verify = self.costs.verify if self.costs is not None else {}
        offered = sorted(((gain, i, s) for i, (s, gain) in self.drafter.siblings.items() if i < n_chain - 1),
                         reverse=True)[:self.settings.max_siblings]
        chosen, n = [], n_chain
        per_token = verify.get(n_chain, 0.0) / max(n_chain, 1)   # a pass's time per token it can emit
        for gain, i, s in offered:
            if n + 1 not in verify or not sibling_pays(gain, verify[n + 1] - verify[n], per_token):
                break
            chosen.append((i, s))
            n += 1
        return sorted(chosen)

    def make(self, ctx, sampling, scratch) -> modes.Verifier:
        """The request's verifier on `ctx` (it makes its own passes: a tree pass, or the chain's)."""
        chain = modes.greedy() if sampling is None else modes.in_numpy(sampling, scratch)

        def chain_path(history, last, drafted, draft_probs):
            tokens = [last] + drafted
            rows = ctx.eval_argmax(tokens, rows="all") if sampling is None else ctx.eval(tokens, logits="all")
            return chain.judge(rows, history, tokens, drafted, draft_probs)

        def verify(history, last, drafted, draft_probs):
            self.passes += 1
            chosen = self.chosen_siblings(len(drafted) + 1) if drafted else []
            siblings = [(i, s) for i, s in chosen if s != drafted[i]]   # a duplicate needs no row (sampling only)
            if not siblings:
                if chosen:   # duplicates alone: the chain's pass, the tree's rule
                    logits = ctx.eval([last] + drafted, logits="all")
                else:
                    return chain_path(history, last, drafted, draft_probs)
            else:
                self.tree_passes += 1
                logits = ctx.eval_tree([last] + drafted, [(i + 1, s) for i, s in siblings])
            chain, k = np.asarray(drafted, dtype=np.int64), len(drafted)
            where = {i: j for j, (i, _) in enumerate(siblings)}
            by_pos = dict(chosen)
            if sampling is None:
                n, token, took = accept_greedy_tree(chain, by_pos, logits[:k + 1].argmax(axis=1))
                bonus = (lambda: int(logits[k + 1 + where[n]].argmax())) if took else None
                target_probs = None
            else:
                out, rows = scratch(k + 1 + len(siblings)), {}

                def target_probs(r: int):
                    if r not in rows:
                        rows[r] = filter_logits(logits[r], sampling.config, out[r])
                    return rows[r]

                n, token, took = accept_rejection_tree(chain, draft_probs, by_pos, target_probs, sampling.rng)
                bonus = (lambda: sample(as_dist(target_probs(k + 1 + where[n])), sampling.rng)) if took else None
            self.drafter.took_sibling = took
            if not took:
                if siblings:
                    ctx.drop_branches()
                return n, token, target_probs
            next_token = bonus()      # read before the branch's row is gone with the next decode
            ctx.take_branch(where[n], n + 1, token)
            drafted[n] = token        # the emitted path: d_1..d_n, then the sibling
            self.siblings_taken += 1
            return n + 1, next_token, target_probs

        return modes.Verifier("own", lambda rows, history, tokens, drafted, draft_probs: verify(
            history, tokens[0], drafted, draft_probs), own_pass=True)


def enable_tree(pair, settings: TreeSettings = TreeSettings(), costs=None) -> TreeVerifier:
    """Verify siblings where they pay from now on: the target's context is remade with 1 + max_siblings sequences
    (its cache starts empty) and the drafter proposes siblings. Needs measured costs: `costs` (policy.Costs), else the
    pair's (Pair.warm_up; measured here when missing). Refuses what it cannot do exactly, with the reason."""
    from .backend.tree import TreeContext

    if not 0.0 < settings.threshold <= 1.0 or not 1 <= settings.max_siblings <= 8:
        raise InvalidParameterError("tree verification: threshold in (0, 1], max_siblings in 1..8")
    if pair.drafter is None or pair.drafter.kind != "model":
        raise InvalidParameterError(
            f"tree verification needs a draft model (drafter 'model', not {pair.drafter_kind!r}): MTP, EAGLE-3 and "
            "DFlash drafts follow the target's decodes, which a tree pass would mix with its siblings'")
    if pair.target.is_recurrent or pair.target.is_hybrid:
        raise InvalidParameterError(
            "tree verification needs an attention-only target: a recurrent or hybrid one would need its recurrent "
            f"state once per branch ({1 + settings.max_siblings} copies in memory) and a state copy into the "
            "committed sequence whenever a sibling stands")
    old = pair.target_ctx
    pair.target_ctx = TreeContext(pair.target, old.options, 1 + settings.max_siblings)
    old.close()
    drafter = TreeDrafter(pair.drafter, settings)
    pair.drafter = drafter   # new contexts and drafter: the pair's engine is made anew for them
    if costs is None and (pair.costs is None or len(pair.costs.verify) < 2):
        pair.warm_up(pair.policy.draft_max + settings.max_siblings)   # verify[n] for every n a tree pass can have
    pair.set_policy(pair.policy)
    pair.tree = tree = TreeVerifier(drafter, settings, costs if costs is not None else pair.costs)
    # the seam: a request's verification is the tree's, except a shaped one (a grammar's rows are numpy's own)
    pair.verifier_wrap = lambda chosen, sampling, shaper, scratch: (
        chosen if shaper is not None else tree.make(pair.target_ctx, sampling, scratch))
    return tree
