"""Pure numpy: sampler filters and the two acceptance rules."""
import numpy as np
import pytest

from support.chisq import assert_follows
from llamaspec.errors import InvalidParameterError
from llamaspec.sampling import (Dist, SamplerConfig, filter_logits, filtered_probs, max_prob, parse_samplers, sample,
                                sample_from)
from llamaspec.verify import accept_greedy, accept_rejection, residual


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    argmax = np.array([5, 6, 9, 8])
    assert accept_greedy(np.array([5, 6, 7]), argmax) == (2, 9)
    assert accept_greedy(np.array([4, 6, 9]), argmax) == (0, 5)
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == (2, 9) and accept_greedy([5, 6], [5, 6, 3]) == (2, 3)
    assert accept_greedy([], np.array([8])) == (0, 8)   # a plain step: the target's own token


def test_greedy_all_accepted_takes_the_bonus_token():
    assert accept_greedy(np.array([5, 6, 9]), np.array([5, 6, 9, 8])) == (3, 8)
    assert accept_greedy(np.array([], dtype=np.int64), np.array([3])) == (0, 3)


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
    dict(min_p=-0.1), dict(min_p=2.0), dict(seed=-3), dict(top_k=2.5), dict(order="llamacpp"), dict(order=None),
])
def test_invalid_sampler_values_name_the_parameter(bad):
    with pytest.raises(InvalidParameterError) as err:
        SamplerConfig(**{**dict(temperature=1.0), **bad})
    assert next(iter(bad)).replace("order", "sampler_order") in str(err.value)


def test_llama_cpp_order_cuts_the_untempered_distribution_then_applies_temperature():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32))
    # top-p 0.7 at T=1 keeps {0, 1}; then T=0.5 squares their probabilities: 0.25 / 0.0625 -> 0.8 / 0.2
    cut_first = SamplerConfig(0.5, top_p=0.7, order="llama.cpp")
    np.testing.assert_allclose(filtered_probs(logits, cut_first), [0.8, 0.2, 0, 0], rtol=1e-5)
    # temperature first: 0.725 / 0.181 / ... of which top-p 0.7 keeps the first alone
    np.testing.assert_allclose(filtered_probs(logits, SamplerConfig(0.5, top_p=0.7)), [1, 0, 0, 0], rtol=1e-5)
    # min-p 0.25 at T=1 keeps p >= 0.125 ({0, 1, 2}); T=2 then flattens them (the square roots)
    kept = np.sqrt([0.5, 0.25, 0.15])
    np.testing.assert_allclose(filtered_probs(logits, SamplerConfig(2.0, min_p=0.25, order="llama.cpp")),
                               [*(kept / kept.sum()), 0], rtol=1e-5)
    assert np.count_nonzero(filtered_probs(logits, SamplerConfig(2.0, min_p=0.25))) == 4  # T first: all pass


@pytest.mark.parametrize("cfg", [SamplerConfig(0.6, top_k=3), SamplerConfig(1.0, top_p=0.8, min_p=0.1),
                                 SamplerConfig(0.7)])
def test_the_orders_agree_where_the_order_cannot_matter(cfg):
    """top-k keeps the same ids at any temperature; at T=1 or without filters there is nothing to reorder."""
    row = next(_rows(n_vocab=5000))
    other = SamplerConfig(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, order="llama.cpp")
    np.testing.assert_allclose(filtered_probs(row, other), filtered_probs(row, cfg), atol=1e-7, rtol=1e-5)
    np.testing.assert_allclose(filter_logits(row, other).dense(5000), filter_logits(row, cfg).dense(5000),
                               atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("spec, order, named", [
    ("top_k;top_p;min_p;temperature", "llama.cpp", {"top_k", "top_p", "min_p", "temperature"}),
    ("temperature;top_k;top_p;min_p", "openai", {"top_k", "top_p", "min_p", "temperature"}),
    ("penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature", "llama.cpp",  # llama.cpp's default list
     {"top_k", "top_p", "min_p", "temperature"}),
    ("top-k;temp;nucleus", "openai", {"top_k", "top_p", "temperature"}),
    (["min_p", "temperature"], "llama.cpp", {"min_p", "temperature"}),
])
def test_samplers_lists_in_llama_cpp_spelling(spec, order, named):
    assert parse_samplers(spec) == (order, frozenset(named))


@pytest.mark.parametrize("spec, why", [
    ("top_p;temperature;min_p", "before both"), ("min_p;top_p;temperature", "min_p before top_p"),
    ("top_k;top_p", "must name temperature"), ("xtc;temperature;mirostat", "'mirostat' is not"),
    ("temp;temperature", "twice"), ([3, "temperature"], "must be names"),
])
def test_samplers_lists_llamaspec_cannot_sample_are_refused_with_the_reason(spec, why):
    with pytest.raises(InvalidParameterError, match=why) as err:
        parse_samplers(spec)
    assert err.value.param == "samplers"


def test_filtered_probs_apply_temperature_topk_topp_minp():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32))
    p = filtered_probs(logits, SamplerConfig(temperature=1.0))
    np.testing.assert_allclose(p, [0.5, 0.25, 0.15, 0.1], rtol=1e-5)
    p = filtered_probs(logits, SamplerConfig(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0, 0], rtol=1e-5)
    p = filtered_probs(logits, SamplerConfig(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 crosses 0.7
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0, 0], rtol=1e-5)
    p = filtered_probs(logits, SamplerConfig(temperature=1.0, min_p=0.25))  # keep p >= 0.125
    np.testing.assert_allclose(p, np.array([0.5, 0.25, 0.15, 0]) / 0.9, rtol=1e-5)
    p = filtered_probs(logits, SamplerConfig(temperature=0.5))
    q = np.array([0.5, 0.25, 0.15, 0.1]) ** 2
    np.testing.assert_allclose(p, q / q.sum(), rtol=1e-5)


def test_top_p_nucleus_wider_than_candidates_is_exact():
    logits = np.zeros(5000, dtype=np.float32)  # uniform: the nucleus needs 90% of 5000 tokens
    p = filtered_probs(logits, SamplerConfig(temperature=1.0, top_p=0.9))
    assert 4490 <= np.count_nonzero(p) <= 4510


def test_filtered_probs_does_not_write_the_logits():
    logits = np.arange(10, dtype=np.float32)
    before = logits.copy()
    filtered_probs(logits, SamplerConfig(temperature=0.7, top_k=3))
    np.testing.assert_array_equal(logits, before)


def test_max_prob_matches_softmax():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    e = np.exp(logits - 3)
    assert max_prob(logits) == pytest.approx(1 / e.sum())


def test_sample_from_follows_the_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.1, 0.0, 0.6, 0.3])
    counts = np.bincount([sample_from(p, rng) for _ in range(20000)], minlength=4) / 20000
    assert counts[1] == 0
    np.testing.assert_allclose(counts, p, atol=0.015)


def test_sample_from_a_large_vocabulary_follows_the_distribution():
    """The two-level sampler (blocks of 1024 ids) on a vocabulary-sized vector with empty blocks, mass at block
    edges and a short last block: the frequencies match and ids of probability 0 never come out."""
    rng = np.random.default_rng(3)
    p = np.zeros(151_936, dtype=np.float32)
    mass = {0: 0.05, 1023: 0.15, 1024: 0.1, 70_000: 0.3, 151_935: 0.2, 151_552: 0.1}
    for i, m in mass.items():
        p[i] = m
    p[5000:6000] = 0.1 / 1000  # a block-spanning spread of small mass
    draws = np.array([sample_from(p, rng) for _ in range(20000)])
    assert np.all(p[draws] > 0)
    for i, m in mass.items():
        assert abs(np.mean(draws == i) - m) < 0.012, i
    assert abs(np.mean((draws >= 5000) & (draws < 6000)) - 0.1) < 0.012


def _rejection_output_distribution(p, q, n=40000, seed=1):
    """Empirical distribution of the first emitted token under speculative sampling with one draft token."""
    rng = np.random.default_rng(seed)
    out = np.zeros(len(p))
    for _ in range(n):
        x = sample_from(q, rng)
        n_acc, nxt = accept_rejection(np.array([x]), q[None, :].copy(), lambda i: p, rng)  # rows are scratch
        out[x if n_acc == 1 else nxt] += 1
    return out / n


def test_rejection_sampling_keeps_the_target_distribution():
    p = np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32)
    q = np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)
    np.testing.assert_allclose(_rejection_output_distribution(p, q), p, atol=0.01)


def test_rejection_sampling_with_a_point_mass_draft():
    p = np.array([0.2, 0.7, 0.1], dtype=np.float32)
    q = np.array([0.0, 0.0, 1.0], dtype=np.float32)  # prompt lookup proposes token 2 deterministically
    np.testing.assert_allclose(_rejection_output_distribution(p, q), p, atol=0.01)


def test_rejection_accepts_everything_when_draft_equals_target():
    p = np.array([0.25, 0.25, 0.5], dtype=np.float32)
    rng = np.random.default_rng(3)
    for _ in range(200):
        drafts = np.array([sample_from(p, rng) for _ in range(3)])
        n_acc, _ = accept_rejection(drafts, np.stack([p, p, p]), lambda i: p, rng)
        assert n_acc == 3


# -- the fast filters and sparse distributions ----------------------------------------------------------------
SETTINGS = [dict(), dict(top_k=1), dict(top_k=40), dict(top_k=3000), dict(top_p=0.95), dict(top_p=0.5),
            dict(min_p=0.05), dict(min_p=0.3), dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_p=0.9, min_p=0.1),
            dict(top_k=200, min_p=0.02)]


def _rows(n_vocab=151_936, seed=0):
    """Logits rows from peaked (a few standout tokens) to nearly flat."""
    rng = np.random.default_rng(seed)
    for scale in (0.2, 1.0, 3.0, 6.0):
        row = (rng.standard_normal(n_vocab) * scale).astype(np.float32)
        row[rng.integers(0, n_vocab, 6)] += rng.uniform(0, 14, 6).astype(np.float32)
        yield row


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "temp")
@pytest.mark.parametrize("temperature", [0.4, 0.8, 1.5])
@pytest.mark.parametrize("order", ["openai", "llama.cpp"])
def test_filter_logits_follows_the_reference_rule(settings, temperature, order):
    cfg = SamplerConfig(temperature=temperature, order=order, **settings)
    for row in _rows():
        before = row.copy()
        ref = filtered_probs(row, cfg)
        got = filter_logits(row, cfg)
        np.testing.assert_array_equal(row, before)  # logits are read, never written
        dense = got.dense(len(row))
        assert np.count_nonzero(dense) == np.count_nonzero(ref)
        np.testing.assert_allclose(dense, ref, atol=2e-7, rtol=1e-4)
        assert got.ids is not None or not settings  # only temperature alone comes back dense
        assert got.max_prob() == pytest.approx(ref.max(), rel=1e-5)


def test_top_k_of_a_flat_row_keeps_exactly_k():
    row = np.full(50_000, 0.5, dtype=np.float32)
    row[::7] += 1e-3
    d = filter_logits(row, SamplerConfig(temperature=1.0, top_k=25))
    assert len(d.ids) == 25 and np.all(row[d.ids] == row.max())


def test_dist_probabilities_dense_sparse_and_past_a_short_vocabulary():
    dense = Dist(None, np.array([1.0, 3.0], dtype=np.float32))    # a draft vocabulary of 2, target's is larger
    assert dense.prob(1) == pytest.approx(0.75) and dense.prob(5) == 0.0
    sparse = Dist(np.array([7, 2]), np.array([0.2, 0.6], dtype=np.float32))
    assert sparse.prob(2) == pytest.approx(0.75) and sparse.prob(3) == 0.0
    np.testing.assert_allclose(sparse.probs_at(np.array([2, 9, 7])), [0.75, 0.0, 0.25])
    np.testing.assert_allclose(dense.probs_at(np.array([1, 9])), [0.75, 0.0])


def test_sample_uses_a_dists_own_draw_once():
    rng = np.random.default_rng(0)
    d = Dist(np.array([4, 8]), np.array([0.5, 0.5], dtype=np.float32), 1.0, draw=8)
    assert sample(d, rng) == 8 and d.draw == -1
    assert {sample(Dist(np.array([4, 8]), np.array([0.5, 0.5]), 1.0), rng) for _ in range(50)} == {4, 8}
    outside = Dist(np.array([4, 8]), np.array([1.0, 0.0], dtype=np.float32), 1.0, draw=8)  # a draw of no mass
    assert sample(outside, rng) == 4


def test_sparse_sampling_follows_the_distribution():
    rng = np.random.default_rng(1)
    d = Dist(np.array([900, 3, 70_000]), np.array([0.2, 0.0, 0.6], dtype=np.float32))
    draws = np.array([sample(d, rng) for _ in range(20000)])
    assert set(draws.tolist()) == {900, 70_000}
    assert abs(np.mean(draws == 900) - 0.25) < 0.012


def test_residual_lives_on_the_targets_support():
    p = Dist(np.array([1, 5, 9]), np.array([0.5, 0.3, 0.2], dtype=np.float32))
    q = Dist(np.array([5, 9, 12]), np.array([0.1, 0.4, 0.5], dtype=np.float32))
    r = residual(p, q)
    np.testing.assert_allclose(r.dense(13), np.array([0, 0.5, 0, 0, 0, 0.2, 0, 0, 0, 0, 0, 0, 0]) / 0.7, atol=1e-6)
    same = residual(p, p)  # p == q: the residual vanishes and is p itself
    np.testing.assert_allclose(same.dense(13), p.dense(13))


def _dense(p, ids=None):
    return Dist(None, np.asarray(p, dtype=np.float32)) if ids is None else \
        Dist(np.asarray(ids), np.asarray(p, dtype=np.float32)[np.asarray(ids)])


@pytest.mark.parametrize("p_sparse, q_sparse", [(True, True), (True, False), (False, True), (False, False)])
def test_rejection_sampling_with_sparse_rows_keeps_the_target_distribution(p_sparse, q_sparse):
    """Target and draft supports overlap only partly (the filters kept different tokens); every mix of dense and
    sparse rows gives the target's distribution."""
    p = np.array([0.0, 0.45, 0.3, 0.15, 0.1, 0.0], dtype=np.float32)
    q = np.array([0.3, 0.1, 0.0, 0.2, 0.0, 0.4], dtype=np.float32)
    p_row = _dense(p, np.flatnonzero(p)) if p_sparse else _dense(p)
    q_row = _dense(q, np.flatnonzero(q)) if q_sparse else _dense(q)
    rng = np.random.default_rng(5)
    out = np.zeros(len(p))
    n = 40000
    for _ in range(n):
        x = sample(q_row, rng)
        n_acc, nxt = accept_rejection(np.array([x]), [q_row], lambda i: p_row, rng)
        out[x if n_acc == 1 else nxt] += 1
    np.testing.assert_allclose(out / n, p, atol=0.01)


@pytest.mark.parametrize("order", ["openai", "llama.cpp"])
def test_rejection_sampling_keeps_the_filtered_target_distribution_in_either_order(order):
    """Draft and target rows filtered by filter_logits (top-k 40, top-p 0.9, min-p 0.05 at T=0.7): the speculative
    output (two draft tokens, the first token emitted) follows the target's filtered distribution by chi-square,
    and the two orders give different distributions (so each is tested for itself)."""
    rng = np.random.default_rng(11)
    n_vocab = 3000
    target = (rng.standard_normal(n_vocab) * 2.0).astype(np.float32)
    target[:12] += np.linspace(6, 3, 12, dtype=np.float32)
    draft = target + rng.standard_normal(n_vocab).astype(np.float32) * 1.5  # disagrees often
    cfg = SamplerConfig(0.7, top_k=40, top_p=0.9, min_p=0.05, order=order)
    p = filtered_probs(target, cfg).astype(np.float64)
    other = SamplerConfig(0.7, top_k=40, top_p=0.9, min_p=0.05, order="openai" if order == "llama.cpp" else order)
    assert order == "openai" or np.abs(filtered_probs(target, other) - p).sum() > 0.05
    counts = np.zeros(n_vocab)
    accepted = 0
    for _ in range(8000):
        q = filter_logits(draft, cfg)
        drafts = np.array([sample(q, rng), sample(q, rng)])
        n_acc, nxt = accept_rejection(drafts, [q, q], lambda i: filter_logits(target, cfg), rng)
        counts[drafts[0] if n_acc >= 1 else nxt] += 1
        accepted += n_acc
    assert 0 < accepted < 16000
    assert_follows(counts, p)


@pytest.mark.parametrize("p_sparse", [False, True])
def test_a_rejection_takes_the_targets_own_draw_where_it_has_one_and_the_output_stays_exact(p_sparse):
    """Target rows as the device hands them, each with a draw of its own (y ~ p): after a rejection the draw is kept
    with chance max(0, p(y) - q(y)) / p(y), else the residual is sampled in full. The token after a rejection
    follows normalize(max(0, p - q)) exactly, the emitted token follows p, and the draw saves the full residual in
    about Z = sum max(0, p - q) of the rejections."""
    import llamaspec.verify as verify

    p = np.array([0.0, 0.45, 0.3, 0.15, 0.1, 0.0], dtype=np.float32)
    q = np.array([0.3, 0.1, 0.0, 0.2, 0.0, 0.4], dtype=np.float32)
    resid = np.maximum(p - q, 0.0) / np.maximum(p - q, 0.0).sum()
    device, rng = np.random.default_rng(11), np.random.default_rng(12)
    q_row = _dense(q)
    built = []
    real_residual, real_dense = verify.residual, verify._dense_residual   # a dense p's residual: _dense_residual
    verify.residual = lambda a, b: (built.append(1), real_residual(a, b))[1]
    verify._dense_residual = lambda a, b: (built.append(1), real_dense(a, b))[1]
    try:
        emitted, after_rejection = np.zeros(len(p)), np.zeros(len(p))
        n = 40000
        for _ in range(n):
            p_row = _dense(p, np.flatnonzero(p)) if p_sparse else _dense(p)
            p_row.draw = int(device.choice(len(p), p=p / p.sum()))
            x = sample(q_row, rng)
            n_acc, nxt = accept_rejection(np.array([x]), [q_row], lambda i: p_row, rng)
            emitted[x if n_acc == 1 else nxt] += 1
            if n_acc == 0:
                after_rejection[nxt] += 1
                assert p_row.draw == -1   # used once
    finally:
        verify.residual, verify._dense_residual = real_residual, real_dense
    assert_follows(emitted.astype(int), p)
    assert_follows(after_rejection.astype(int), resid)
    z = np.maximum(p - q, 0.0).sum()
    rejections = after_rejection.sum()
    assert abs(len(built) / rejections - (1 - z)) < 0.03   # the residual built only where the draw was not kept


def _residual_by_the_formula(p: Dist, q: Dist) -> Dist:
    """normalize(max(0, p - q)) written out with every scaling (the construction the fast paths must equal)."""
    r = np.multiply(p.weights, np.float32(1.0 / p.total), dtype=np.float32)
    if q.ids is None:
        n = min(len(q.weights), len(r))
        r[:n] -= q.weights[:n] * np.float32(1.0 / q.total)
    else:
        inside = q.ids < len(r)
        r[q.ids[inside]] -= q.weights[inside] / np.float32(q.total)
    np.maximum(r, 0.0, out=r)
    out = Dist(None, r)
    return Dist(None, p.weights, p.total) if out.total <= 0.0 else out


def _residual_cases(n: int = 5000):
    rng = np.random.default_rng(3)

    def row(dtype=np.float32, size=n, normalised=True):
        w = np.exp(rng.standard_normal(size) * 2).astype(dtype)
        return Dist(None, (w / w.sum(dtype=np.float64)).astype(dtype), 1.0) if normalised else Dist(None, w)

    p = row()
    yield p, row()                                           # the device's rows: both normalised
    yield row(normalised=False), row(normalised=False)       # numpy's filters: unnormalised weights
    yield p, row(normalised=False)
    yield row(normalised=False), row()
    yield row(np.float64), row(np.float64)                   # probability vectors
    yield p, row(np.float64)
    yield p, row(size=n - 300)                               # a draft vocabulary shorter than the target's
    yield row(size=n - 300), row()                           # ... or longer
    ids = rng.choice(n, 40, replace=False)
    yield p, Dist(ids, rng.random(40).astype(np.float32))   # a sparse q (a draft's candidates on the device)
    peaked = np.full(n, 1e-6, dtype=np.float32)               # p's mass on q's ids, some of it above q there
    peaked[ids[:10]] = rng.random(10).astype(np.float32)
    q_over = rng.random(40).astype(np.float32)
    yield Dist(None, peaked / peaked.sum(dtype=np.float64)), Dist(ids, q_over)
    yield Dist(None, peaked), Dist(ids, q_over * np.float32(3.0))   # neither normalised
    beyond = np.concatenate([ids[:30], n + np.arange(10)])      # a draft vocabulary longer than the target's
    yield p, Dist(beyond, rng.random(40).astype(np.float32))
    yield p, Dist(None, p.weights.copy(), 1.0)               # p == q: the residual vanishes


def test_the_dense_residual_equals_the_formula_to_the_bit():
    from llamaspec.verify import _dense_residual

    for p, q in _residual_cases():
        want = _residual_by_the_formula(p, q)
        got = residual(p, q)
        assert got.weights.dtype == want.weights.dtype and np.array_equal(got.weights, want.weights)
        assert got.total == want.total
        if want.weights is not p.weights:   # it did not vanish
            assert np.array_equal(_dense_residual(p, q), want.weights)


def test_a_sparse_drafts_residual_over_a_dense_row_is_drawn_without_building_it(monkeypatch):
    """A target row of the whole vocabulary (temperature only on the device) and a draft of a few candidates: the
    residual differs from p only at the draft's ids, so it is drawn from p's block sums corrected there, with no
    vector of the vocabulary's size written; the draws follow normalize(max(0, p - q))."""
    import llamaspec.verify as verify
    from llamaspec.verify import sample_residual

    monkeypatch.setattr(verify, "_dense_residual", lambda p, q: pytest.fail("built the dense residual"))
    n, rng = 6000, np.random.default_rng(5)
    p = np.full(n, 0.2 / (n - 6), dtype=np.float32)        # 80% of p on six ids, in two blocks (0-1023, 5120-)
    heavy = np.array([3, 7, 900, 5200, 5201, 5999])
    p[heavy] = [0.3, 0.2, 0.1, 0.1, 0.05, 0.05]
    ids = np.array([3, 7, 900, 5200, 11, 5998])            # q covers four of them, two heavier than p
    q = np.array([0.5, 0.1, 0.1, 0.25, 0.03, 0.02], dtype=np.float32)
    want = np.maximum(p.astype(np.float64) - np.bincount(ids, q, n), 0.0)
    draws = np.zeros(n)
    for _ in range(20000):
        draws[sample_residual(Dist(None, p, 1.0), Dist(ids, q, 1.0), rng)] += 1
    groups = [[3], [7], [900], [5200], [5201], [5999], [11, 5998]]   # the ids that matter, and the rest together
    rest = np.setdiff1d(np.arange(n), np.concatenate(groups))
    assert_follows(np.array([draws[g].sum() for g in groups] + [draws[rest].sum()]).astype(int),
                   np.array([want[g].sum() for g in groups] + [want[rest].sum()]) / want.sum())
    assert draws[3] == 0 and draws[900] == 0                 # where q >= p the residual is 0
    # p equal to q on q's ids and nothing elsewhere: no residual, so p is drawn (as a vanished residual is)
    only = np.zeros(n, dtype=np.float32)
    only[ids] = q
    for seed in range(20):
        assert sample_residual(Dist(None, only, 1.0), Dist(ids, q, 1.0), np.random.default_rng(seed)) in ids


def test_sample_residual_draws_what_sampling_the_formula_draws():
    """Without a draw of p's own, sample_residual takes the same token from the same random stream as sampling the
    residual built by the formula (the vanishing residual included: then p is sampled)."""
    from llamaspec.verify import sample_residual

    for p, q in _residual_cases():
        for seed in range(20):
            before, after = np.random.default_rng(seed), np.random.default_rng(seed)
            want = sample(_residual_by_the_formula(p, q), before)
            assert sample_residual(Dist(None, p.weights, p._total), q, after) == want
            assert after.random() == before.random()   # as many random numbers used


def test_a_dense_rows_total_and_its_draw_share_one_pass_over_the_vocabulary(monkeypatch):
    """p(x) asks a dense row's total, and a rejection then draws from the same row: its block sums are computed once
    (float32 blocks, float64 across them: the total within float32's rounding of the float64 sum), kept by a copy,
    and the draws still follow the row."""
    import llamaspec.sampling as sampling
    from llamaspec.verify import sample_residual

    calls = []
    real = sampling._block_sums
    monkeypatch.setattr(sampling, "_block_sums", lambda probs: calls.append(len(probs)) or real(probs))
    n, rng = 9000, np.random.default_rng(3)
    w = rng.random(n).astype(np.float32) ** 8
    w[[10, 4100, 8999]] = [40.0, 30.0, 20.0]
    p = Dist(None, w)
    assert abs(p.total - float(w.sum(dtype=np.float64))) <= 1e-6 * p.total
    q = Dist(np.array([10, 4100]), np.array([0.9, 0.1], dtype=np.float32))
    sample_residual(p, q, rng)
    sample(p.copy(), rng)
    assert calls == [n]
    draws = np.bincount([sample(Dist(None, w), rng) for _ in range(6000)], minlength=n)
    groups = [[10], [4100], [8999]]
    rest = np.setdiff1d(np.arange(n), np.concatenate(groups))
    probs = w.astype(np.float64) / w.sum(dtype=np.float64)
    assert_follows(np.array([draws[g].sum() for g in groups] + [draws[rest].sum()]),
                   np.array([probs[g].sum() for g in groups] + [probs[rest].sum()]))
