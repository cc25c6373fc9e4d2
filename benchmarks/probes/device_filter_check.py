"""Device filtering where rollbacks happen: a synthetic qwen35 hybrid pair at T=0.8 with a disagreeing draft (the
target's snapshots restore, the hybrid draft replays), on llama.cpp's sampler chains and on numpy, then the
synthetic MTP head at T=0.8 with the default filters. A correctness check, not a timing: it prints, per reply,
whether the device sampler ran and whether every cache holds exactly what was recorded.

    python benchmarks/probes/device_filter_check.py VOCAB.gguf [OUT_DIR]      # VOCAB: llama.cpp's ggml-vocab-qwen35.gguf

On a GPU build the default (no LLAMASPEC_DEVICE_SAMPLING) filters on the device; on a CPU build set
LLAMASPEC_DEVICE_SAMPLING=1 to see that path there.
"""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from llamaspec import load_pair
from llamaspec.backend.mtp import MTPContext
if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
    sys.exit("usage: device_filter_check.py VOCAB.gguf [OUT_DIR]: VOCAB must be an existing file "
             "(llama.cpp's models/ggml-vocab-qwen35.gguf)")
vocab = sys.argv[1]
d = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="llamaspec-check-")


def say(line):
    print(line, flush=True)


subprocess.run([sys.executable, os.path.join(HERE, "..", "synthetic", "synth_hybrid.py"), d, "--preset", "tiny", "--vocab",
                vocab, "--output-noise", "0.3"], check=True, capture_output=True)
files = sorted(os.listdir(d))
target = os.path.join(d, "qwen35-tiny-target.gguf")
draft = os.path.join(d, "qwen35-tiny-draft-noise0.3.gguf")
for dev in ("1", "0"):
    os.environ["LLAMASPEC_DEVICE_SAMPLING"] = dev
    pair = load_pair(target, draft, policy="fixed", draft_max=4, n_ctx=512, n_rs_seq=4)
    t0, ok = time.perf_counter(), True
    try:
        for seed in range(4):
            pair.reset()
            c = pair.generate([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=80, temperature=0.8, top_k=40, seed=seed)
            held = [ctx.memory_len() == ctx.n_in_memory for ctx in (pair.target_ctx, *pair.drafter.contexts)]
            say(f"hybrid dev={dev} seed {seed}: {len(c.tokens)} tokens, drafted {c.stats.drafted} accepted "
                f"{c.stats.accepted}, device_sampler {pair.target_ctx.device_sampler}, caches consistent {held}, "
                f"rollback {type(pair.target_ctx.rollback).__name__}")
    except Exception as e:
        ok = False
        say(f"hybrid dev={dev} FAILED {type(e).__name__}: {e}")
    say(f"hybrid dev={dev}: {time.perf_counter() - t0:.2f} s, ok {ok}")
    pair.close()
mtp = os.path.join(d, "mtp-tiny.gguf")
subprocess.run([sys.executable, os.path.join(HERE, "..", "synthetic", "synth_mtp.py"), mtp, "--preset", "tiny", "--agree", "0.7"],
               check=True, capture_output=True)
calls, orig = [0], MTPContext.last_dist


def counted(self):
    calls[0] += 1
    return orig(self)


MTPContext.last_dist = counted
os.environ.pop("LLAMASPEC_DEVICE_SAMPLING", None)
pair = load_pair(mtp, drafter="mtp", n_ctx=512, n_rs_seq=3, policy="fixed", draft_max=3)
try:
    c = pair.generate([5, 6, 7], max_tokens=80, temperature=0.8, seed=1)
    say(f"mtp T=0.8 default: drafted {c.stats.drafted} accepted {c.stats.accepted}, last_dist calls {calls[0]}, "
        f"device_sampler target {pair.target_ctx.device_sampler} head {pair.drafter.ctx.device_sampler}")
except Exception as e:
    say(f"mtp FAILED {type(e).__name__}: {e}")
