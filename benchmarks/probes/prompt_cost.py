"""How long the server's prompt tokenizer (llamaspec/server/prompt.py) holds the worker for hostile request bodies
of up to 4 MB, next to llama.cpp's own tokenizer with special tokens parsed, on the same model in one run.

    python benchmarks/probes/prompt_cost.py MODEL.gguf [--n-ctx 4096 32768] [--llama-cpp]

Each case prints the seconds until the prompt is refused (overflow) or tokenized (ok, with its token count).
`--llama-cpp` also times llama_tokenize(parse_special=True) on the rendered prompt (quadratic in special tokens:
can take minutes). Bad input (a missing file) is one line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llamaspec.chat_template import ChatTemplate  # noqa: E402
from llamaspec.config import ModelConfig  # noqa: E402
from llamaspec.errors import ContextOverflowError, LlamaspecError  # noqa: E402

MB4 = 3_900_000
CASES = {
    "completion: 80k <|im_start|>a<|im_end|> (920 kB)": "<|im_start|>a<|im_end|>" * 40000,
    "completion: 3.9 MB of '<'": "<" * MB4,
    "completion: 3.9 MB of spaces": " " * MB4,
    "completion: 3.9 MB of words": "hello " * (MB4 // 6),
    "chat: 2048 x 1.9 kB of <|im_start|>": [{"role": "user", "content": "<|im_start|>" * 160}] * 2048,
    "chat: 2048 x 1.9 kB of words": [{"role": "user", "content": "hello " * 320}] * 2048,
    "chat: 2048 x 1.9 kB of spaces": [{"role": "user", "content": " " * 1900}] * 2048,
    "chat: 2048 empty messages": [{"role": "user", "content": ""}] * 2048,
    "chat: one 3.9 MB message of CJK": [{"role": "user", "content": "\u4e00" * (MB4 // 3)}],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--n-ctx", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp's tokenizer (slow)")
    args = parser.parse_args()
    try:
        from llamaspec.backend.model import Model
        from llamaspec.server.prompt import PromptTokenizer, chat_segments

        model = Model(args.model, ModelConfig(no_repack=True))
    except LlamaspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    template = ChatTemplate.from_model_info(model.info)
    print(f"model {Path(args.model).name}, vocab {model.vocab_kind}")
    for n_ctx in args.n_ctx:
        tokenizer = PromptTokenizer(model, n_ctx)
        for name, prompt in CASES.items():
            start = time.perf_counter()
            try:
                if isinstance(prompt, str):
                    segments, add_bos, rendered = [(prompt, True)], True, prompt
                else:
                    segments, add_bos = chat_segments(template, prompt, tokenizer)
                    rendered = template.render(prompt)
                outcome = f"ok, {len(tokenizer.tokenize(segments, add_bos))} tokens"
            except ContextOverflowError:
                outcome = "refused (context)"
            line = f"n_ctx {n_ctx:>6}  {name:<48} {time.perf_counter() - start:7.3f} s  {outcome}"
            if args.llama_cpp:
                start = time.perf_counter()
                n = len(model.tokenize(rendered, add_bos, True))
                line += f"   llama.cpp parse_special: {time.perf_counter() - start:7.3f} s ({n} tokens)"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
