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
