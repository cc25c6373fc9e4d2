"""Several streams at once: N requests decoded together (Pair.generate_batch: one target pass verifies every
stream's draft) against one stream at a time (Pair.generate), and against llama.cpp's llama-server with -np N and
the same drafter (N concurrent requests; its own default flags plus what the case needs, as peers.py builds them).
Prints a markdown report (also written to --out) with every command; greedy, or one of bench_engine's sampled
regimes (--regime filters: T with llama.cpp's default filters on both sides; temp: temperature only), each stream
its own seed.

    python benchmarks/compare/bench_parallel.py --target T.gguf --draft D.gguf [--streams 4] [--k 4] \
        [--tokens 128] [--policy fixed|auto] [--regime greedy|filters|temp] [--temperature 0.8] [--tools DIR]
        [--out results.md]
    python benchmarks/compare/bench_parallel.py --target T-with-MTP.gguf --drafter mtp ...

Figures: total tok/s (all streams' tokens over the wall time), each stream's tok/s (its tokens over its own time),
and one stream's tok/s alone; where a batched step's time went (drafting, the target's decode, the rest), averaged
over its steps. With --policy auto (k the longest draft) a stream alone runs auto too and the batch's lengths are
chosen together (policy/batch.py: its end-of-run line is printed). The prompts are bench_engine's (code and prose),
cycled to N.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    from . import peers
    from .bench_engine import CODE, PROSE, hardware
except ImportError:
    import peers
    from bench_engine import CODE, PROSE, hardware
from llamaspec import bounds, load_pair  # noqa: E402
from llamaspec.targets import batch_support  # noqa: E402
from llamaspec.errors import LlamaspecError  # noqa: E402
from llamaspec.gguf.reader import read_model_info  # noqa: E402
from llamaspec.gguf.spec_kind import spec_kind  # noqa: E402
from llamaspec.kinds import KINDS  # noqa: E402


def llamaspec_rows(a, prompts: list[str]) -> list[dict]:
    settings = dict(n_ctx=a.ctx, n_gpu_layers=a.ngl, policy=a.policy, draft_max=a.k, no_repack=a.no_repack or None,
                    drafter=a.drafter)
    # each stream its own seed, the same alone and together
    requests = [dict(max_tokens=a.tokens, seed=i + 1, **a.regime.llamaspec_kwargs()) for i in range(len(prompts))]
    with load_pair(a.target, a.draft, **settings) as pair:
        why = batch_support(pair)   # None: one target pass for all streams; else they run one after another
        pair.generate("warm up", **(requests[0] | {"max_tokens": 8}))
        pair.generate_batch(["warm up"] * len(prompts), requests=[r | {"max_tokens": 8} for r in requests])
        t0 = time.perf_counter()
        alone = [pair.generate(p, **r) for p, r in zip(prompts, requests)]
        alone_s = time.perf_counter() - t0
        engine = pair.engine(len(prompts), a.ctx * len(prompts)) if why is None else None
        before = dataclasses.replace(engine.times) if engine is not None else None
        t0 = time.perf_counter()
        together = pair.generate_batch(prompts, requests=requests)
        together_s = time.perf_counter() - t0
        phases = None
        if engine is not None and pair._shared is engine:
            after, steps = engine.times, engine.times.steps - before.steps
            draft, decode = after.draft - before.draft, after.decode - before.decode
            phases = {"steps": steps, "draft_ms": 1e3 * draft / steps, "decode_ms": 1e3 * decode / steps,
                      "rest_ms": 1e3 * (after.total - before.total - draft - decode) / steps,
                      "outside_ms": 1e3 * (together_s - (after.total - before.total)) / steps,
                      "policy": engine.policy.describe() if a.policy == "auto" else None,
                      # the share of each stream's generation spent outside llama.cpp (its decodes and rollbacks)
                      "python": sum(c.stats.python_overhead for c in together) / len(together),
                      # greedy: whether batching changed any stream's tokens (a near-tie can, where the batched
                      # kernels round differently; a wrong row would too)
                      "same": sum(x.tokens == y.tokens for x, y in zip(alone, together))
                      if a.regime.name == "greedy" else None}
    one = sum(len(c.tokens) for c in alone) / alone_s
    per_stream = [len(c.tokens) / c.stats.time_total for c in together]
    return [{"engine": "llamaspec", "mode": "one stream at a time", "total_tps": one, "streams": 1,
             "stream_tps": [len(c.tokens) / c.stats.time_total for c in alone],
             "accepted_per_pass": sum(c.stats.mean_accepted_length for c in alone) / len(alone)},
            {"engine": "llamaspec", "mode": f"{len(prompts)} streams together" if why is None else
             f"{len(prompts)} streams asked together, run one after another ({why})", "streams": len(prompts),
             "total_tps": sum(len(c.tokens) for c in together) / together_s, "stream_tps": per_stream,
             "vs_one_stream": sum(len(c.tokens) for c in together) / together_s / one,
             "accepted_per_pass": sum(c.stats.mean_accepted_length for c in together) / len(together),
             "phases": phases}]


def server_rows(a, prompts: list[str]) -> list[dict]:
    exe = Path(a.tools) / "llama-server" if a.tools else None
    if exe is None or not exe.is_file():
        return [{"engine": "llama-server", "mode": f"-np {len(prompts)}", "skipped": f"{exe or 'no --tools'}: "
                 "not found"}]
    file_kind = spec_kind(read_model_info(a.draft)) if a.draft else None   # an EAGLE-3 / DFlash draft: its kind
    spec_type = KINDS[file_kind].spec_type if file_kind in KINDS else \
        {"model": "draft-simple", "mtp": "draft-mtp", "lookup": "ngram-simple"}.get(a.drafter)
    if spec_type is None:
        return [{"engine": "llama-server", "mode": f"-np {len(prompts)}", "skipped": f"no llama.cpp drafter is "
                 f"{a.drafter}"}]
    case = peers.Case(a.target, a.draft, spec_type, a.ctx * len(prompts), a.ngl, a.no_repack)
    port = peers.free_port()
    cmd = peers.server_cmd(exe, case, a.k, port) + ["-np", str(len(prompts))]
    body = [peers.request_body(a.regime, p, a.tokens) for p in prompts]   # (its default: a random seed)
    with tempfile.TemporaryDirectory() as tmp, peers.PeerServer(cmd, port, Path(tmp) / "server.log") as server:
        server.complete(body[0] | {"n_predict": 8})
        t0 = time.perf_counter()
        alone = [server.complete(b) for b in body]
        alone_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(body)) as pool:
            together = list(pool.map(server.complete, body))
        together_s = time.perf_counter() - t0
    one = sum(r["tokens"] for r in alone) / alone_s
    total = sum(r["tokens"] for r in together) / together_s
    return [{"engine": "llama-server", "mode": "one request at a time", "streams": 1, "total_tps": one,
             "stream_tps": [r["per_second"] for r in alone], "cmd": peers.shown(cmd)},
            {"engine": "llama-server", "mode": f"-np {len(prompts)}, {len(prompts)} concurrent", "streams":
             len(prompts), "total_tps": total, "stream_tps": [r["per_second"] for r in together],
             "vs_one_stream": total / one, "cmd": peers.shown(cmd) + f" ; POST /completion {json.dumps(body[0])}"}]


def report(a, rows: list[dict]) -> str:
    policy = "auto, the longest" if a.policy == "auto" else "fixed"
    drafter = Path(a.draft).name if a.draft else "no draft" if a.drafter == "model" else f"drafter {a.drafter}"
    lines = [f"# Parallel streams: {Path(a.target).name} + {drafter}",
             "", f"Hardware: {hardware()}. {a.regime.describe()[:1].upper()}{a.regime.describe()[1:]}, draft length "
             f"{a.k} ({policy}), {a.tokens} tokens per stream.", "",
             "| engine | mode | total tok/s | per stream tok/s | vs one stream | tokens/pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['engine']} | {r['mode']} | skipped: {r['skipped']} | | | |")
            continue
        streams = ", ".join(f"{t:.2f}" for t in r["stream_tps"])
        ratio = f"{r['vs_one_stream']:.2f}x" if "vs_one_stream" in r else ""
        per_pass = f"{r['accepted_per_pass']:.2f}" if "accepted_per_pass" in r else ""
        lines.append(f"| {r['engine']} | {r['mode']} | {r['total_tps']:.2f} | {streams} | {ratio} | {per_pass} |")
    for r in rows:
        if r.get("phases"):
            ph = r["phases"]
            lines += ["", f"A batched step of llamaspec ({r['mode']}), mean of {ph['steps']} steps: drafting "
                      f"{ph['draft_ms']:.2f} ms, target decode {ph['decode_ms']:.2f} ms, the rest of the step "
                      f"{ph['rest_ms']:.2f} ms; outside the steps (generate_batch's loop) {ph['outside_ms']:.2f} ms. Outside "
                      f"llama.cpp (Python): {100 * ph['python']:.1f}% of a stream's generation, the streams' mean."]
            if ph["same"] is not None:
                lines += ["", f"Greedy: {ph['same']} of {len(r['stream_tps'])} streams gave the same tokens together as "
                          "alone."]
            if ph["policy"]:
                lines += ["", f"- {ph['policy']}"]
    lines += ["", "Commands:", "", f"    python {' '.join(sys.argv)}"]
    lines += [f"    {r['cmd']}" for r in rows if r.get("cmd")]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--drafter", default="model", choices=["model", "mtp", "lookup", "lookup+model"],
                   help="mtp: the target's own head (no --draft); llama-server gets --spec-type draft-mtp")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--k", type=int, default=4, help="the draft length (fixed) or the longest (auto)")
    p.add_argument("--policy", default="fixed", choices=["fixed", "auto"],
                   help="auto: each stream alone runs auto, and the batch's lengths are chosen together")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--ctx", type=int, default=2048, help="per stream")
    p.add_argument("--ngl", type=int, default=-1)
    p.add_argument("--no-repack", action="store_true")
    p.add_argument("--tools", help="llama.cpp's bin folder (llama-server)")
    p.add_argument("--regime", default="greedy", choices=peers.REGIME_NAMES,
                   help="greedy; filters: --temperature with llama.cpp's default filters; temp: temperature only")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--out")
    a = p.parse_args()
    try:   # the one range every entry point takes (llamaspec.bounds)
        bounds.check("temperature", a.temperature, param="--temperature")
    except LlamaspecError as e:
        p.error(str(e))
    if a.regime != "greedy" and a.temperature == 0:
        p.error(f"--regime {a.regime} samples: give a --temperature above 0")
    a.regime = peers.parse_regimes(a.regime, a.temperature)[0]
    prompts = [(CODE + PROSE)[i % 8] for i in range(a.streams)]
    try:
        text = report(a, llamaspec_rows(a, prompts) + server_rows(a, prompts))
    except LlamaspecError as e:   # a missing or damaged file, a pair that cannot batch: one line
        p.error(str(e))
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
