"""The `auto` policy's whole benchmark in one command: synthetic files of known agreement, then bench_engine's
uniform and mixed sessions on a hybrid's MTP head and on a draft model, and four parallel streams on the head, with
the peers at their defaults; then one table of `auto` against the best fixed k and the peers.

    python benchmarks/compare/auto_suite.py OUT_DIR --vocab-dir DIR [--tools BIN] [--ik-tools BIN]
        [--preset gpu|tiny] [--only UNIT,...] [--regimes greedy,filters,temp] [--tokens N] [--dry-run]
    python benchmarks/compare/auto_suite.py OUT_DIR --summary

--vocab-dir: llama.cpp's models/ folder (ggml-vocab-qwen35.gguf and ggml-vocab-qwen2.gguf: real tokenizers, so
that every peer loads the files). The work is cut into units, one file and one sampling regime each
(`uniform-mtp-greedy`, `mixed-pair-filters`, `parallel-mtp-temp-chains`, ...; `--list` names them); a unit writes
OUT_DIR/UNIT.md (and .json) and is skipped once its report is final, so a run cut short (a time limit on each
command, a lost machine) resumes where it stopped. A model file is written when the first unit that needs it runs
(under NAME.partial until its script succeeds), and removed when no unit left to run needs it (at --preset gpu the
four files are 16-19 GiB each). Every command is printed before it runs.

Units, each in every regime asked for:
- uniform-mtp: `synth_mtp.py --preset 27b --agree 0.7` (Qwen3.6-27B's hybrid shapes, a 70% MTP head), bench_engine
  with k=1,2,3, plain, fixed, auto and auto+warm over 2 code and 2 prose prompts; peers at the same drafter
- mixed-mtp: the same file with agreement 0.95, 0.7, 0.4, 0.1 in runs of 2048 tokens, bench_engine's mixed session
- uniform-pair, mixed-pair: `synth_pair.py --preset 32b` (Qwen2.5-32B's shapes and a 2-block draft), 0.7 and the
  same runs as the MTP file (--seed 4: the five requests meet about 95, 11, 68, 91 and 34%), k=1,2,3,5,8
- useless-pair: the pair with a draft that agrees 4% of the time (a draft `auto` should stop using), k=1
- parallel-mtp: bench_parallel, four streams of the MTP file at k=2, against llama-server -np 4; in the sampled
  regimes once more with the batch engine's sampling chains (`-chains`: LLAMASPEC_BATCH_DEVICE_SAMPLING=1)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SYNTH = HERE.parent / "synthetic"
REGIMES = ("greedy", "filters", "temp")
RUNS = "0.95,0.7,0.4,0.1"   # the mixed files' agreement, in runs of 2048 tokens along the greedy walk
PRESETS = {   # preset: (synth_mtp preset, synth_pair preset, tokens a request)
    "gpu": ("27b", "32b", 128),
    "tiny": ("tiny", "tiny", 32),
}
ENGINE = ["--modes", "plain,fixed,auto,auto+warm", "--temp", "0.8"]


@dataclass
class ModelFile:
    name: str                       # under OUT_DIR/models
    script: str                     # synthetic/...
    args: list                      # after the output path
    paths: list = field(default_factory=list)   # what it writes, relative to its name


@dataclass
class Unit:
    name: str
    model: str                      # a ModelFile's name
    command: list                   # after the interpreter; {models} is the models folder
    env: dict = field(default_factory=dict)


def model_files(preset: str, vocab_dir: Path) -> dict[str, ModelFile]:
    mtp, pair, _ = PRESETS[preset]
    qwen35, qwen2 = str(vocab_dir / "ggml-vocab-qwen35.gguf"), str(vocab_dir / "ggml-vocab-qwen2.gguf")
    files = [ModelFile("mtp.gguf", "synth_mtp.py", ["--preset", mtp, "--agree", "0.7", "--vocab", qwen35]),
             ModelFile("mtpmix.gguf", "synth_mtp.py",
                       ["--preset", mtp, "--agree", RUNS, "--agree-run", "2048", "--vocab", qwen35]),
             ModelFile("pair", "synth_pair.py", ["--preset", pair, "--agree", "0.7", "--vocab", qwen2]),
             ModelFile("pair04", "synth_pair.py", ["--preset", pair, "--agree", "0.04", "--vocab", qwen2]),
             ModelFile("pairmix", "synth_pair.py",
                       ["--preset", pair, "--agree", RUNS, "--agree-run", "2048", "--vocab", qwen2, "--seed", "4"])]
    return {f.name: f for f in files}


def units(regimes: list[str], tokens: int, peers: str, tools: list[str], extra: list[str],
          server: Path | None = None) -> list[Unit]:
    """Every unit, in the order they run (each model file's units together, so that it can go when they are done).
    `tools`: bench_engine's peer folders; `server`: llama.cpp's, for bench_parallel's llama-server."""
    engine = ["benchmarks/compare/bench_engine.py", *ENGINE, "--tokens", str(tokens), "--peers", peers, *tools, *extra]
    uniform, mixed = ["--prompts", "code,prose", "--per-set", "2"], ["--workload", "mixed"]
    mtp = lambda f: ["--target", f"{{models}}/{f}", "--drafter", "mtp", "--k", "1,2,3"]   # noqa: E731
    pair = lambda d, k="1,2,3,5,8": ["--target", f"{{models}}/{d}/target.gguf",  # noqa: E731
                                     "--draft", f"{{models}}/{d}/draft.gguf", "--k", k]
    out = []
    for unit, model, args in (("uniform-mtp", "mtp.gguf", [*uniform, *mtp("mtp.gguf")]),
                              ("parallel-mtp", "mtp.gguf", None),
                              ("mixed-mtp", "mtpmix.gguf", [*mixed, *mtp("mtpmix.gguf")]),
                              ("uniform-pair", "pair", [*uniform, *pair("pair")]),
                              ("useless-pair", "pair04", [*uniform, *pair("pair04", "1")]),
                              ("mixed-pair", "pairmix", [*mixed, *pair("pairmix")])):
        for regime in regimes:
            if args is not None:
                out.append(Unit(f"{unit}-{regime}", model, [*engine, "--regimes", regime, *args]))
                continue
            parallel = ["benchmarks/compare/bench_parallel.py", "--target", f"{{models}}/{model}", "--drafter", "mtp",
                        "--streams", "4", "--k", "2", "--tokens", str(tokens), "--regime", regime,
                        *(["--tools", str(server)] if server else []), *[x for x in extra if x == "--no-repack"]]
            out.append(Unit(f"{unit}-{regime}", model, parallel))
            if regime != "greedy":   # greedy slots take their argmax on the device either way
                out.append(Unit(f"{unit}-{regime}-chains", model, parallel, {"LLAMASPEC_BATCH_DEVICE_SAMPLING": "1"}))
    return out


def finished(out_dir: Path, unit: Unit) -> bool:
    """A unit whose report is final (and for bench_engine its JSON whole): bench_engine marks a report cut short (it
    writes the report again after each peer); bench_parallel writes its report at the end only."""
    md, js = out_dir / f"{unit.name}.md", out_dir / f"{unit.name}.json"
    if not md.is_file() or "**Partial" in md.read_text(encoding="utf-8", errors="replace"):
        return False
    if "bench_engine.py" not in unit.command[0]:
        return True
    try:   # the JSON is written after the report: a run killed between the two left it out or cut
        json.loads(js.read_text())
    except (OSError, ValueError):
        return False
    return True


def run(cmd: list[str], env: dict | None = None, dry: bool = False) -> None:
    shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"$ {shown + ' ' if shown else ''}{shlex.join(cmd)}", flush=True)
    if dry:
        return
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})})
    if done.returncode:
        raise SystemExit(f"auto_suite: the command above failed (exit {done.returncode})")


def ensure_model(models: Path, f: ModelFile, dry: bool, made: set) -> None:
    """Write the file (a pair: its folder) under a temporary name and rename it when the script succeeded, so that
    one cut short is never taken for a whole one."""
    path, partial = models / f.name, models / (f.name + ".partial")
    if path.exists() or f.name in made:
        made.add(f.name)
        return
    if not dry and partial.exists():
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
    run([sys.executable, str(SYNTH / f.script), str(partial), *f.args], dry=dry)
    if not dry:
        partial.rename(path)
    made.add(f.name)


def remove_model(models: Path, f: ModelFile, dry: bool) -> None:
    path = models / f.name
    print(f"# {f.name}: no unit left needs it, removed", flush=True)
    if not dry:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


# -- the summary ----------------------------------------------------------------------------------------------------

def _best(rows: list[dict], engine_prefix: str, mode_prefix: str = "") -> dict | None:
    ran = [r for r in rows if r["engine"].startswith(engine_prefix) and r["mode"].startswith(mode_prefix)
           and r.get("tok_s") and not r.get("skipped")]
    return max(ran, key=lambda r: r["tok_s"], default=None)


def summary_rows(out_dir: Path) -> list[str]:
    """One line per bench_engine unit: auto (cold and warm) against the best fixed k (plain is k=0: where no draft
    pays, as with the useless draft, plain is the one to beat), llama-server's best k,
    ik_llama.cpp's best fixed k and its autotune (the faster of the two tuners), and the mixed sessions' ceiling."""
    try:
        from .bench_engine import PEER_LABELS, per_request_best
    except ImportError:
        from bench_engine import PEER_LABELS, per_request_best
    lines = ["| unit | plain | best fixed k or plain | auto | auto+warm | auto / best (cold, warm) | ceiling / best "
             "| llama-server best | auto / llama-server | ik best fixed | ik autotune | auto / ik autotune |",
             "|---" * 12 + "|"]
    for js in sorted(out_dir.glob("*.json")):
        try:
            rows = json.loads(js.read_text())
        except (OSError, ValueError) as e:   # a run killed while writing it: its unit runs again
            lines.append(f"| {js.stem} | unreadable ({e.__class__.__name__}) |" + " |" * 10)
            continue
        mine = [r for r in rows if r["engine"] == "llamaspec"]
        by_mode = {r["mode"]: r for r in mine}
        fixed = _best([r for r in mine if r["mode"] == "plain" or r["mode"].startswith("fixed")], "llamaspec")
        auto, warm, plain = by_mode.get("auto"), by_mode.get("auto+warm"), by_mode.get("plain")
        server = _best(rows, "llama-server")
        ik = [r for r in rows if r["engine"] == PEER_LABELS["ik"]]
        ik_fixed = _best(ik, "")
        tuner = _best([r for r in rows if r["engine"].startswith(PEER_LABELS["ik-autotune"])], "")
        oracle = per_request_best([SimpleNamespace(mode=r["mode"], runs=r.get("request_tok_s") or [],
                                                   run_tokens=r.get("request_tokens") or [])
                                   for r in mine if r["mode"] == "plain" or r["mode"].startswith("fixed")])
        tps = lambda r: f"{r['tok_s']:.2f}" if r else "-"                       # noqa: E731
        ratio = lambda x, y: f"{x['tok_s'] / y['tok_s']:.3f}" if x and y else "-"   # noqa: E731
        with_k = lambda r: f"{r['tok_s']:.2f} ({r['mode']})" if r else "not run"  # noqa: E731
        ceiling = f"{oracle[0] / fixed['tok_s']:.3f}" if oracle and fixed and "mixed" in js.stem else "-"
        # where no draft pays (plain best), the peers ran drafts only: a ratio to them would flatter auto
        to_peer = ratio if not (fixed and fixed["mode"] == "plain") else lambda x, y: "-"
        lines.append(f"| {js.stem} | {tps(plain)} | {with_k(fixed)} | {tps(auto)} | {tps(warm)} | "
                     f"{ratio(auto, fixed)}, {ratio(warm, fixed)} | {ceiling} | {with_k(server)} | "
                     f"{to_peer(auto, server)} | {with_k(ik_fixed)} | {tps(tuner)} | {to_peer(auto, tuner)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--vocab-dir", type=Path, help="llama.cpp's models/ folder (its ggml-vocab-*.gguf files)")
    ap.add_argument("--models", type=Path, help="where the synthetic files go [OUT_DIR/models]")
    ap.add_argument("--tools", type=Path, help="llama.cpp's bin folder (llama-server) for the llama-server peer")
    ap.add_argument("--ik-tools", type=Path, help="ik_llama.cpp's bin folder for its peers (fixed k and autotune)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu",
                    help="gpu: the 27B and 32B shapes; tiny: a CPU check of the whole suite [gpu]")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--tokens", type=int, help="new tokens a request [128 at gpu, 32 at tiny]")
    ap.add_argument("--only", help="run these units only (comma-separated; a prefix names several: mixed-mtp)")
    ap.add_argument("--extra", default="", help="more bench_engine options (e.g. '--no-repack --threads 2')")
    ap.add_argument("--keep-models", action="store_true", help="keep each model file after its last unit")
    ap.add_argument("--list", action="store_true", help="name the units and whether each is done, then stop")
    ap.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    ap.add_argument("--summary", action="store_true", help="only the table of the finished units")
    a = ap.parse_args()
    if a.summary:
        print("\n".join(summary_rows(a.out_dir)))
        return
    regimes = [r.strip() for r in a.regimes.split(",") if r.strip()]
    if not regimes or any(r not in REGIMES for r in regimes):
        ap.error(f"--regimes: choose from {', '.join(REGIMES)}")
    tokens = a.tokens if a.tokens is not None else PRESETS[a.preset][2]
    if tokens < 1:
        ap.error("--tokens must be at least 1")
    peers, tools = [], []
    for flag, folder, names in (("--tools", a.tools, ["llama-server"]),
                                ("--ik-tools", a.ik_tools, ["ik", "ik-autotune", "ik-autotune-own"])):
        if folder is None:
            continue
        if not (folder / "llama-server").is_file():
            ap.error(f"{flag}: no llama-server in {folder}")
        peers += names
        tools += [flag, str(folder)]
    plan = units(regimes, tokens, ",".join(peers), tools, shlex.split(a.extra), a.tools)
    if a.only:
        wanted = [w.strip() for w in a.only.split(",") if w.strip()]
        unknown = [w for w in wanted if not any(u.name.startswith(w) for u in plan)]
        if unknown:
            ap.error(f"--only: no unit named {', '.join(unknown)} (--list names them)")
        plan = [u for u in plan if any(u.name.startswith(w) for w in wanted)]
    a.out_dir.mkdir(parents=True, exist_ok=True)
    if a.list:
        for u in plan:
            print(f"{u.name:32s} {'done' if finished(a.out_dir, u) else 'to run'}")
        return
    if a.vocab_dir is None or not all((a.vocab_dir / f"ggml-vocab-{v}.gguf").is_file() for v in ("qwen35", "qwen2")):
        ap.error("--vocab-dir: give llama.cpp's models/ folder (ggml-vocab-qwen35.gguf and ggml-vocab-qwen2.gguf)")
    models = a.models or a.out_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    files = model_files(a.preset, a.vocab_dir.resolve())
    todo = [u for u in plan if not finished(a.out_dir, u)]
    for u in plan:
        if u not in todo:
            print(f"# {u.name}: done ({a.out_dir / (u.name + '.md')})", flush=True)
    made: set[str] = set()
    for i, u in enumerate(todo):
        ensure_model(models, files[u.model], a.dry_run, made)
        cmd = [sys.executable, *[c.replace("{models}", str(models.resolve())) for c in u.command],
               "--out", str((a.out_dir / f"{u.name}.md").resolve())]
        if "bench_engine.py" in u.command[0]:
            cmd += ["--json", str((a.out_dir / f"{u.name}.json").resolve())]
        run(cmd, u.env, a.dry_run)
        if not a.keep_models and not any(later.model == u.model for later in todo[i + 1:]):
            remove_model(models, files[u.model], a.dry_run)
    print("\n".join(summary_rows(a.out_dir)))
    parallel = sorted(p.name for p in a.out_dir.glob("parallel-*.md"))
    if parallel:
        print(f"\nparallel streams (their own reports): {', '.join(parallel)}")


if __name__ == "__main__":
    main()
