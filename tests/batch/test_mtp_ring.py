"""The batched MTP head after its ring of hidden states lost rows it needed (batched_mtp.SeqMTP.catch_up's "start
over" path): the head begins a fresh cache at the current position and drafting goes on; the output is still each
prompt's own (drafts only change speed). The ring is sized so that this does not happen in normal runs; here it is
shrunk under the engine on purpose. llama.cpp's tiny qwen35 with an MTP head (skipped without test-llama-archs)."""
from __future__ import annotations

from support.mtp_models import make_mtp_model
from llamaspec import load_pair
from llamaspec.targets import batch_support
from llamaspec.drafters.mtp import HiddenRing

SETTINGS = dict(n_ctx=256, n_batch=64, no_repack=True, n_threads=1, flash_attn="off")
PROMPTS = [list(range(10, 60)), [3, 17, 42, 99, 5, 64, 23, 8, 77] * 4, list(range(70, 110)), [1, 2, 3]]


def test_a_head_that_lost_its_ring_starts_over_and_the_output_is_unchanged(tmp_path):
    target = make_mtp_model("qwen35", tmp_path, head="agree", trunk_mix=0.1)
    with load_pair(str(target), drafter="mtp", policy="fixed", draft_max=3, **SETTINGS) as p:
        assert batch_support(p) is None
        expected = [p.generate(q, max_tokens=24) for q in PROMPTS]
        p.generate_batch([[5, 6]] * 4, n_seq=4, max_tokens=2)    # makes the batch engine of 4 slots
        heads = p._shared.target.mtp.seqs
        for s in heads:                                          # a ring far shorter than a prompt
            s.ring = HiddenRing(4, s.ring.rows.shape[1])
        got = p.generate_batch(PROMPTS, n_seq=4, max_tokens=24)
        # the heads of the three long prompts started over: positions before the restart hold no token (-1)
        assert [-1 in s.seq.tokens for s in heads] == [True, True, True, False]
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        assert sum(c.stats.drafted for c in got) > 0 and sum(c.stats.accepted for c in got) > 0


def test_the_ring_hands_back_the_states_it_holds_and_none_for_one_it_lost():
    """What a head reads when it catches up: the states of a stretch of positions (a view of the ring where they lie
    in one stretch of it, a copy across its end), zeros before the first position, None when a row was
    overwritten by a later position (the head then starts over)."""
    import numpy as np

    ring = HiddenRing(8, 3)
    rows = np.arange(30, dtype=np.float32).reshape(10, 3)
    ring.remember(rows[:6], 0)                                   # positions 0..5 at rows 0..5
    assert np.array_equal(ring.states(2, 3), rows[2:5])
    assert np.array_equal(ring.states(-1, 2), np.vstack([np.zeros(3), rows[0]]))   # none before position 0
    ring.remember(rows[6:10], 6)                                  # 6..9: rows 6, 7, then 0, 1 (wrapped)
    assert np.array_equal(ring.states(6, 4), rows[6:10])          # across the ring's end
    assert ring.states(0, 1) is None and ring.states(1, 2) is None   # 0 and 1 were overwritten by 8 and 9
    assert np.array_equal(ring.states(2, 4), rows[2:6])
    ring.remember(rows[:1] + 100, 12)                             # position 12 takes row 4 from position 4
    assert ring.states(3, 3) is None                               # a lost row in the middle of a stretch
    assert np.array_equal(ring.states(12, 1), rows[:1] + 100)
    assert ring.states(5, 0).shape == (0, 3)


def test_a_common_prefix_is_the_same_short_or_long():
    from llamaspec.drafters.base import common_prefix_len

    import numpy as np

    for n in (0, 1, 3, 31, 32, 33, 100):
        a = list(range(n))
        for cut in range(n + 1):
            b = a[:cut] + [-5] + a[cut + 1:] if cut < n else a + [7]
            assert common_prefix_len(a, b) == cut
            assert common_prefix_len(np.array(a), b, start=min(cut, 2)) == cut
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2 and common_prefix_len([], [1]) == 0
