"""What `auto` costs a step inside the engine, apart from the lengths it chooses: one load, one prompt, four policies
that draft the same lengths, their Python milliseconds a step (time outside llama.cpp's decodes and the caches'
rollback, as the Python share counts it) in interleaved rounds, and `auto` itself beside them:

    fixed        FixedPolicy(k)
    replay       k every step through a replaying policy object, no bookkeeping
    replay-mix   the same, the lengths changing as an `auto` trace changed them (--mix) at each request's start
    replay+auto  replay, with an AutoPolicy told every step (its update runs; its choices are not taken)
    auto         the load's own AutoPolicy (the costs measured at load), choosing its lengths

replay - fixed is what a policy object costs the engine, replay-mix - replay what changes of length cost, replay+auto
- replay what `auto`'s own bookkeeping costs; auto - replay+auto what its own choices (their lengths, its shadow
probes) cost a step beyond that. replay+auto's AutoPolicy starts from the costs the H100's 27B hybrid measured at load
(llamaspec.bench.H100_MTP27B_COSTS), so that it reasons as it did there.

    python benchmarks/probes/auto_step_cost.py --target T.gguf --drafter mtp [--k 2] [-n 256] [--repeat 5]
        [--mix 0s03333333333333333333332222222222] [--no-repack --threads 2]
"""
from __future__ import annotations

import argparse
import statistics

from llamaspec import load_pair
from llamaspec.bench import H100_MTP27B_COSTS
from llamaspec.policy import AutoPolicy, DraftPolicy, FixedPolicy

# auto's first request on the H100's 27B MTP file, greedy (h100-auto-suite-uniform-mtp-greedy-at-1dfe9ae.md)
FIRST_REQUEST = "0s0333333333333333333332222222222222222222222222222222222221"


class Replay(DraftPolicy):
    """Draft the lengths of `lengths` in turn ('s'/'x', a shadow probe in a trace, drafts `k`; past the end, `k`),
    starting again at each request; `inner`, if given, is told every step."""

    name = "replay"

    def __init__(self, lengths: str, k: int, draft_max: int, inner: DraftPolicy | None = None):
        self.lengths, self.k, self.draft_max, self.inner, self.i = lengths, k, draft_max, inner, 0

    def new_request(self) -> None:
        self.i = 0
        if self.inner is not None:
            self.inner.new_request()

    def next_draft_len(self) -> int:
        c = self.lengths[self.i] if self.i < len(self.lengths) else str(self.k)
        return self.k if c in "sx" else int(c)

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        self.i += 1
        if self.inner is not None:
            self.inner.update(drafted, accepted, draft_seconds, verify_seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="draft GGUF (or --drafter)")
    ap.add_argument("--drafter", help="mtp, lookup, ... (as load_pair's drafter)")
    ap.add_argument("--k", type=int, default=2, help="the length drafted where no sequence says otherwise")
    ap.add_argument("--mix", default=FIRST_REQUEST, help="the lengths replay-mix drafts at each request's start")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt", default="def quicksort(arr):")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    a = ap.parse_args()
    if not a.draft and not a.drafter:
        ap.error("give --draft or --drafter")
    if a.k < 1 or a.n < 1 or a.repeat < 1 or set(a.mix) - set("0123456789sx"):
        ap.error("--k, -n and --repeat: at least 1; --mix: digits, s and x")
    reach = max(a.k, *(int(c) for c in a.mix if c.isdigit()))
    drafting = {"drafter": a.drafter} if a.drafter else {}
    pair = load_pair(a.target, a.draft, policy="auto", draft_max=reach, n_ctx=2048, n_threads=a.threads,
                     no_repack=a.no_repack, **drafting)

    def watcher() -> AutoPolicy:
        policy = AutoPolicy(draft_max=reach)
        policy.attach("per_token", H100_MTP27B_COSTS)
        return policy

    variants = {"fixed": lambda: FixedPolicy(a.k),
                "replay": lambda: Replay("", a.k, reach),
                "replay-mix": lambda: Replay(a.mix, a.k, reach),
                "replay+auto": lambda: Replay("", a.k, reach, inner=watcher()),
                "auto": lambda: AutoPolicy(draft_max=reach)}
    pair.generate(a.prompt, max_tokens=16)   # warm-up
    runs: dict[str, list] = {name: [] for name in variants}
    for _ in range(a.repeat):
        for name, make in variants.items():
            pair.set_policy(make())   # set_policy attaches the load's costs (auto's calibration)
            pair.reset()
            runs[name].append(pair.generate(a.prompt, max_tokens=a.n).stats)
    print(f"{pair.drafter_kind} drafter, k={a.k}, reach {reach}, {a.n} tokens, {a.repeat} interleaved rounds")
    print("| policy | Python ms a step (median) | drafted a step | tok/s (median) | each round's Python ms |")
    print("|---|---|---|---|---|")
    for name, stats in runs.items():
        ms = [s.python_ms_per_step for s in stats]
        drafted = sum(s.drafted for s in stats) / max(sum(s.target_passes for s in stats), 1)
        tps = statistics.median(s.tokens_per_second for s in stats)
        print(f"| {name} | {statistics.median(ms):.3f} | {drafted:.2f} | {tps:.1f} | "
              f"{' '.join(f'{v:.3f}' for v in ms)} |")


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()
