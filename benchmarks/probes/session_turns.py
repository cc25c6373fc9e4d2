"""Sessions taking turns on one slot: the prompt tokens each turn processes again, and what saving and restoring a
slot's state costs.

Sessions A and B alternate on the engine's one slot (A1, B1, A2, B2, A3, B3); each turn's prompt is the session's
chat so far rendered by the chat template (the model's, or --template FILE), with each earlier answer carrying a
<think> block that the Qwen3.5 template drops when it renders the turn again. Per turn: the prompt's tokens, the
tokens reused (restored or kept) and the tokens processed; then the state cache's saves and restores with their
cost in ms per MiB. Run it at another commit (its package first on PYTHONPATH) for the figures before.

    python benchmarks/probes/session_turns.py --model M.gguf [--template Qwen3.5-4B.jinja] [--system-words 600]
"""
from __future__ import annotations

import argparse

from llamaspec import load_pair
from llamaspec.chat_template import ChatTemplate

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 5) % len(WORDS)] for i in range(n))


def conversation(session: int, turns: int, system_words: int) -> list[dict]:
    messages = [{"role": "system", "content": f"You are agent {session}. " + text(session, system_words)}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of {session}: " + text(session + t, 60)})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"<think>\nstep {t}: {text(t, 30)}\n</think>\n\n"
                                                             f"answer {t}: {text(session + 3 * t, 40)}"})
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--template", help="a Jinja chat template file (default: the model's)")
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with load_pair(args.model, n_ctx=8192, n_batch=512, no_repack=True, n_threads=args.threads,
                   flash_attn="off") as pair:
        template = ChatTemplate(open(args.template).read()) if args.template else \
            ChatTemplate.from_model_info(pair.target.info)
        engine = pair.engine(1)
        for session, turn in ((65, 1), (66, 1), (65, 2), (66, 2), (65, 3), (66, 3)):
            tokens = pair.tokenize(template.render(conversation(session, turn, args.system_words)))
            slot = engine.submit(tokens, max_tokens=8)
            for _ in engine.pieces(slot):
                pass
            stats = slot.stats
            print(f"{chr(session)}{turn}: prompt {len(tokens)}, reused {stats.prompt_tokens_cached}, processed "
                  f"{len(tokens) - stats.prompt_tokens_cached}, prefill {stats.time_prefill:.2f} s", flush=True)
        cache = getattr(engine.target, "cache", None)
        if cache is not None:
            saved, restored = cache.bytes_saved / 2**20, cache.bytes_restored / 2**20
            print(f"cache: {cache.saves} saves, {cache.restores} restores, {saved:.1f} MiB saved, {restored:.1f} MiB "
                  f"restored; save {cache.save_seconds * 1e3:.1f} ms ({cache.save_seconds * 1e3 / max(saved, 1e-9):.2f}"
                  f" ms/MiB), restore {cache.restore_seconds * 1e3:.1f} ms "
                  f"({cache.restore_seconds * 1e3 / max(restored, 1e-9):.2f} ms/MiB)")


if __name__ == "__main__":
    main()
