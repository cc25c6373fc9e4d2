"""Tree verification: siblings beside the chain keep the output exactly the target's (greedy: plain decoding; sampling:
the target's distribution), over a fake tree backend and over real attention models."""
import os
from pathlib import Path

import numpy as np
import pytest

from support.chisq import assert_follows
from support.fakes import FakeContext, FakeModel, plain_pair
from llamaspec.drafters import make_drafter
from llamaspec.engine import Pair
from llamaspec.errors import InvalidParameterError
from llamaspec.policy import Costs, FixedPolicy
from llamaspec.sampling import SamplerConfig, filtered_probs
from llamaspec.tree import (TreeSettings, accept_greedy_tree, accept_rejection_tree, enable_tree, sibling_pays)

PROMPT = [5, 9, 11, 3]
ALWAYS_PAYS = Costs(verify={n: 1.0 for n in range(1, 40)})   # flat verify cost: any sibling with a chance pays


class TwoPeakModel(FakeModel):
    """A draft that, where it disagrees, still ranks the target's token second: greedy siblings stand often."""

    def logits(self, tokens):
        row = super().logits(tokens)
        row[self.true_next(tokens)] += 0.8 * self.sharpness
        return row


class FakeTreeContext(FakeContext):
    """FakeContext with the tree pass of backend/tree.py: a sibling's row is the model's row after its own path."""

    def eval_tree(self, chain, siblings):
        base = self.n_past
        rows = self.eval(chain, logits="all").copy()
        sib = [self.model.logits(self.tokens[:base + i] + [s]) for i, s in siblings]
        self.decoded.extend(s for _, s in siblings)
        self._base = base
        return np.concatenate([rows, np.stack(sib)])

    def take_branch(self, j, i, token):
        del self.tokens[self._base + i:]
        self.tokens.append(token)

    def drop_branches(self):
        pass


class FakeTarget(FakeModel):
    is_recurrent = is_hybrid = False


def tree_pair(k=3, disagree=0.5, draft_cls=TwoPeakModel, settings=TreeSettings(0.99, 2), **kw):
    target = FakeTarget(**kw)
    draft = draft_cls(disagree=disagree, salt=3, **kw)
    pair = Pair(target, FakeContext(target), make_drafter("model", target, FakeContext(draft)), FixedPolicy(k))
    import llamaspec.backend.tree as backend_tree
    real = backend_tree.TreeContext
    backend_tree.TreeContext = lambda model, options, n_seq: FakeTreeContext(model)
    try:
        pair.target_ctx.options = None
        enable_tree(pair, settings, costs=ALWAYS_PAYS)
    finally:
        backend_tree.TreeContext = real
    return pair


# -- the rules ---------------------------------------------------------------------------------------------------
def test_greedy_tree_rule_takes_the_sibling_only_at_the_first_mismatch():
    chain = np.array([4, 5, 6])
    assert accept_greedy_tree(chain, {1: 9}, np.array([4, 9, 6, 7])) == (1, 9, True)
    assert accept_greedy_tree(chain, {2: 9}, np.array([4, 9, 6, 7])) == (1, 9, False)   # sibling elsewhere
    assert accept_greedy_tree(chain, {1: 9}, np.array([4, 5, 6, 7])) == (3, 7, False)   # all stood: the bonus


def test_sibling_pays_only_when_its_token_is_worth_its_row():
    assert sibling_pays(0.3, 0.001, 0.01)
    assert not sibling_pays(0.05, 0.001, 0.01)


def test_recursive_rejection_over_two_drafts_keeps_p_exactly():
    """One node, two i.i.d. draws from q, the rule of tree.py: the emitted token follows p."""
    rng = np.random.default_rng(0)
    p = np.array([0.05, 0.4, 0.3, 0.05, 0.2])
    q = np.array([0.5, 0.1, 0.1, 0.2, 0.1])
    counts = np.zeros(5)
    for _ in range(20000):
        x1, x2 = rng.choice(5, p=q), rng.choice(5, p=q)
        sib = {0: int(x2)}   # x2 == x1 too: a sure rejection, still one round of the rule
        n, token, took = accept_rejection_tree(np.array([x1]), [q], sib, lambda i: p if i == 0 else p, rng)
        counts[x1 if n == 1 else token] += 1
    assert_follows(counts, p)


# -- the engine with a fake tree backend --------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tree_equals_plain_decoding(k):
    expected = plain_pair().generate(PROMPT, max_tokens=80).tokens
    pair = tree_pair(k)
    c = pair.generate(PROMPT, max_tokens=80)
    assert c.tokens == expected
    assert pair.tree.siblings_taken > 0 and pair.tree.tree_passes > 0   # the tree did run and mattered
    assert pair.target_ctx.tokens == PROMPT + c.tokens[:-1]              # the cache holds the emitted path


def test_a_sibling_that_stands_brings_more_tokens_per_pass():
    chain_only = tree_pair(3, settings=TreeSettings(1e-9, 1))   # no node is ever unsure enough
    tree = tree_pair(3)
    a = chain_only.generate(PROMPT, max_tokens=120).stats
    b = tree.generate(PROMPT, max_tokens=120).stats
    assert chain_only.tree.tree_passes == 0 and chain_only.tree.drafter.unsure == 0
    assert b.target_passes < a.target_passes
    assert tree.tree.drafter.unsure >= tree.tree.tree_passes > 0   # unsure positions offered the siblings


def test_unsure_positions_are_counted_even_where_no_sibling_pays():
    """The report tells a draft that was never unsure from siblings whose rows never paid."""
    pair = tree_pair(3, settings=TreeSettings(0.99, 2))
    pair.tree.costs = None   # no measured verify costs: no sibling row is ever known to pay
    pair.generate(PROMPT, max_tokens=40)
    assert pair.tree.drafter.unsure > 0 and pair.tree.tree_passes == 0


def test_sampled_tree_keeps_the_target_distribution():
    """The first two tokens at T>0 (node 0's recursive rule and the sibling's own row for the bonus) follow the
    target's distribution: first token p(.|PROMPT), second the mixture over the first."""
    cfg = SamplerConfig(temperature=1.0, top_k=10)
    pair = tree_pair(1, disagree=1.0, settings=TreeSettings(1.0, 1), sharpness=1.5)
    n = 3000
    first, second = np.zeros(pair.n_vocab), np.zeros(pair.n_vocab)
    for seed in range(n):
        c = pair.generate(PROMPT, max_tokens=2, temperature=1.0, top_k=10, seed=seed)
        drawn = c.tokens + [pair.target.eog] * (2 - len(c.tokens))   # an end-of-generation token ends it
        first[drawn[0]] += 1
        if drawn[0] != pair.target.eog:
            second[drawn[1]] += 1
    assert pair.tree.siblings_taken > 50
    p0 = filtered_probs(pair.target.logits(PROMPT), cfg).astype(np.float64)
    on = [t for t in np.flatnonzero(p0) if t != pair.target.eog]
    p1 = sum(p0[t] * filtered_probs(pair.target.logits(PROMPT + [t]), cfg).astype(np.float64) for t in on)
    p1 /= p1.sum()
    assert_follows(first, p0)
    assert_follows(second, p1)


def test_trees_are_refused_where_they_cannot_be_exact():
    target = FakeTarget()
    mtp_like = Pair(target, FakeContext(target), make_drafter("lookup", target), FixedPolicy(3))
    with pytest.raises(InvalidParameterError, match="needs a draft model"):
        enable_tree(mtp_like, costs=ALWAYS_PAYS)
    hybrid = FakeTarget()
    hybrid.is_hybrid = True
    pair = Pair(hybrid, FakeContext(hybrid), make_drafter("model", hybrid, FakeContext(FakeModel())), FixedPolicy(3))
    with pytest.raises(InvalidParameterError, match="recurrent state once per branch"):
        enable_tree(pair, costs=ALWAYS_PAYS)


# -- real models --------------------------------------------------------------------------------------------------
def _models() -> Path | None:
    root = os.environ.get("LLAMASPEC_TEST_MODELS")
    return Path(root).expanduser() if root else None


@pytest.mark.parametrize("pair_files", [
    ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct.gguf"),
    ("smollm2-135m-instruct-q4_1.gguf", "smollm2-135m-instruct-q4_1.gguf")])
def test_greedy_tree_on_real_models_equals_plain_decoding(pair_files):
    from llamaspec import load_pair

    root = _models()
    files = [root / f for f in pair_files] if root else []
    if not files or not all(f.is_file() for f in files):
        pytest.skip(f"set LLAMASPEC_TEST_MODELS to a folder with {', '.join(pair_files)}")
    prompt = "def fibonacci(n):"
    with load_pair(str(files[0]), str(files[1]), n_ctx=256, n_threads=2, no_repack=True, policy="fixed",
                   draft_max=3) as pair:
        plain = pair.generate(prompt, max_tokens=1).tokens   # warm
        pair.set_policy(FixedPolicy(0))
        plain = pair.generate(prompt, max_tokens=16).tokens
        pair.set_policy(FixedPolicy(3))
        enable_tree(pair, TreeSettings(0.9, 2), costs=ALWAYS_PAYS)
        pair.reset()
        got = pair.generate(prompt, max_tokens=16).tokens
        assert pair.tree.tree_passes > 0
        assert pair.target_ctx.memory_len() == len(pair.target_ctx.tokens)   # seq 0 holds the emitted path
    assert got == plain


# -- DFlash2 files ------------------------------------------------------------------------------------------------
def test_a_dflash2_draft_is_refused_in_one_line_naming_what_is_missing(tmp_path):
    """A crafted DFlash2 header (llama.cpp PR #27342's selector and convolution tensors): the pair check names the
    selector lattice as what llamaspec's DFlash drafter lacks."""
    from gguf import GGUFWriter

    from llamaspec.gguf.hidden_pair import hidden_pair_mismatch
    from llamaspec.gguf.reader import read_model_info

    w = GGUFWriter(str(tmp_path / "d.gguf"), "dflash")
    w.add_uint32("dflash.block_count", 1)
    w.add_uint32("dflash.selector_top_k", 4)
    w.add_uint32("dflash.selector_rank", 8)
    w.add_array("dflash.target_layers", [1, 2])
    w.add_tensor("fc.weight", np.zeros((4, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_conv_base", np.zeros((2, 3, 8), dtype=np.float32))
    for name in ("selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight"):
        w.add_tensor(name, np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    target = read_model_info(tmp_path / "d.gguf")   # the target is not reached: the draft is refused first
    reason = hidden_pair_mismatch(target, read_model_info(tmp_path / "d.gguf"))
    assert reason is not None and "\n" not in reason
    assert "DFlash2" in reason and "selector lattice" in reason and "draft-dflash" in reason
