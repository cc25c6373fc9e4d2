"""A synthetic qwen35-shaped model with a multi-token-prediction (MTP) head that agrees with the trunk at a known
rate: a speed benchmark for MTP drafting that needs no download. The 27B with Qwen's tokenizer and chat template,
as the agent-session benchmarks use it (VOCAB: llama.cpp's models/ggml-vocab-qwen35.gguf):

    python benchmarks/synthetic/synth_mtp.py qwen35-27b-mtp.gguf --preset 27b --agree 0.7 --vocab VOCAB \
        --chat-template benchmarks/synthetic/templates/Qwen3.5-4B.jinja

    python benchmarks/synthetic/synth_mtp.py OUT.gguf [--preset 27b|tiny] [--agree 0.7] [--scale S] [--seed 0]
        [--vocab VOCAB.gguf] [--chat-template FILE] [--header-only]

Shapes (--preset 27b) follow Qwen3.6-27B: width 5120, 64 blocks (every 4th full attention with 24 query heads,
4 KV heads of 256; the others gated delta-net with 16 key heads and 48 value heads of 128), FFN 17408, a 248320-token
vocabulary, and one nextn block. Every matrix of the blocks is Q4_K and zero (the GPU multiplies zeros as fast as
anything), the embeddings and output matrix are Q8_0, so a token costs what a Q4 model of that size costs (27.3B
parameters, 15.6 GiB, 865 tensors). `tiny` is the same structure at width 256 for a CPU smoke test.
--header-only writes the header and leaves the tensor data a hole (a sparse file of the full size), for what reads
headers only (`llamaspec check`).

What the weights compute. The blocks write nothing into the residual stream, so the trunk's hidden state is
rms_norm(e(x)) of the current token and its next token is sigma(x), where sigma runs through the "good" tokens G in
one cycle (g_i -> g_{i + c mod |G|}): the output row sigma(x) is `scale * e(x)/|e(x)|`, so that logit is
scale * sqrt(n_embd) and the others scale * sqrt(n_embd) * cos(e(x), e(y)), about scale * N(0, 1) (--scale sets how
peaked p is at a temperature). The head reads concat(enorm(e), hnorm(h)) through eh_proj = [I | 0] (the
token-embedding half) and shares the embeddings, the output matrix and the output norm, so it predicts sigma(x) too,
except for a set D of tokens (1 - agree of G, drawn at random): their embedding is e(alias(x)) on the first 7/8 of
the dimensions plus a 4x longer part on the last 1/8, and the head's enorm is 0 there. The trunk still predicts
sigma(x) (the long part dominates and the output row follows it); the head sees only e(alias(x)) and predicts
sigma(alias(x)). A draft token is therefore accepted (greedy) exactly when the token it follows is not in D: each
position independently with probability ~ agree, and the head's own hidden state (chained drafts) changes nothing.
With a list of rates (--agree 0.95,0.7,0.3 --agree-run 1024) D is drawn per run of the cycle instead: the tokens
greedy decoding visits in a row (g_0, g_c, g_2c, ...) take the list's rates in turn, --agree-run tokens each, so one
answer keeps one acceptance rate for hundreds of tokens and the next request, starting elsewhere on the cycle, may
see another: a mixed workload for adaptive draft lengths (sampling leaves the walk and mixes the runs).

The tokenizer. By default llama.cpp's test vocabulary (tokens "tok_0".., no BOS/EOS): G is the whole vocabulary
(sigma(x) = x + c mod V), any text tokenizes, generation never stops early. --vocab copies a vocab-only GGUF's
tokenizer (every tokenizer.* key; the token list padded with unused [PAD<id>] tokens up to the preset's vocabulary,
as Qwen's files are padded, or the preset takes the file's size where that is larger) and --chat-template writes
tokenizer.chat_template. Random tokens of a real vocabulary are not text (byte pieces of UTF-8, control tokens, an
end of generation), so G is then the normal tokens that decode on their own to a plain word or identifier (an
optional leading space) or one of a few code punctuation pieces, byte-level BPE mapped back to bytes: text a chat
template's parsers read as plain content. Every other token x behaves as a good token (its embedding is that of a
random good token), so sigma maps every token into G; and its output row reads only dimension 0, which every
embedding carries at BIAS x its length and no good row reads: its logit is about -BAD_ROW x BIAS x sqrt(n_embd), so
no sampler ever picks it. Generated text is therefore valid UTF-8 at any temperature, and never ends early.
llamaspec, llama.cpp and ik_llama.cpp load the files (ik_llama.cpp does not know the test vocabulary).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter, TokenType
from gguf.quants import quantize

PRESETS = {
    # n_embd, blocks, n_ff, heads, kv heads, head dim, delta-net key heads, value heads, state, vocab
    "27b": dict(n_embd=5120, n_layer=64, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256, n_group=16, dt_rank=48,
                d_state=128, n_vocab=248320, rope_dim=64, sections=(11, 11, 10, 0)),
    "tiny": dict(n_embd=256, n_layer=4, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_group=2, dt_rank=4,
                 d_state=64, n_vocab=4096, rope_dim=64, sections=(11, 11, 10, 0)),
}
ARCH = "qwen35"
FULL_ATTENTION_INTERVAL = 4
ROWS_PER_CHUNK = 4096
B_FRACTION = 8          # the last n_embd / B_FRACTION dimensions carry the D tokens' long part
B_LENGTH = 4.0          # |long part| / |short part|
BIAS = 0.125            # dimension 0 of every embedding (with a real vocabulary): BIAS x |dimensions 1..n_a|
BAD_ROW = 256.0         # -dimension 0 of a token's output row outside G: its logit ~ -BAD_ROW * BIAS * sqrt(n_embd)
# the text of a good token: a word or identifier with an optional leading space, or a code punctuation piece
GOOD_TEXT = re.compile(r" ?[A-Za-z_][A-Za-z0-9_]*|\n|[.,:;()]| =| \+| -")


def gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes: GPT-2's bytes_to_unicode, inverted (printable bytes stand for
    themselves, the others for chr(256 + k))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


def good_tokens(tokens: list[str], token_types: list[int]) -> np.ndarray:
    """The ids of the normal tokens whose bytes are, on their own, valid UTF-8 matching GOOD_TEXT."""
    decoder = gpt2_byte_decoder()
    good = []
    for i, (piece, kind) in enumerate(zip(tokens, token_types)):
        if kind != TokenType.NORMAL:
            continue
        try:
            text = bytes(decoder[ch] for ch in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if GOOD_TEXT.fullmatch(text):
            good.append(i)
    return np.array(good, dtype=np.int64)


class Tokenizer:
    """The tokenizer.* fields of a vocab-only GGUF, the token list padded to n_vocab with unused tokens."""

    def __init__(self, path: Path, n_vocab: int, chat_template: str | None):
        try:
            reader = GGUFReader(path)
        except (OSError, ValueError) as error:   # a missing, truncated or foreign file
            raise SystemExit(f"error: {path}: not a readable GGUF file ({error})") from None
        self.fields = {key: (field.types, field.contents()) for key, field in reader.fields.items()
                       if key.startswith("tokenizer.")}
        if "tokenizer.ggml.tokens" not in self.fields or "tokenizer.ggml.token_type" not in self.fields:
            raise SystemExit(f"error: {path} has no token list and token types")
        tokens, types = (self.fields[k][1] for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
        if self.fields["tokenizer.ggml.model"][1] != "gpt2":
            raise SystemExit(f"error: {path}: a byte-level BPE (gpt2) vocabulary is needed to tell text tokens apart")
        self.good = good_tokens(tokens, types)
        self.n_vocab = max(n_vocab, len(tokens))
        pad = range(len(tokens), self.n_vocab)
        self.fields["tokenizer.ggml.tokens"] = (self.fields["tokenizer.ggml.tokens"][0],
                                                tokens + [f"[PAD{i}]" for i in pad])
        self.fields["tokenizer.ggml.token_type"] = (self.fields["tokenizer.ggml.token_type"][0],
                                                    types + [int(TokenType.UNUSED)] * len(pad))
        if "tokenizer.ggml.scores" in self.fields:
            self.fields["tokenizer.ggml.scores"] = (self.fields["tokenizer.ggml.scores"][0],
                                                    self.fields["tokenizer.ggml.scores"][1] + [0.0] * len(pad))
        if chat_template is not None:
            self.fields["tokenizer.chat_template"] = ([GGUFValueType.STRING], chat_template)

    def write(self, w: GGUFWriter) -> None:
        for key, (types, value) in self.fields.items():
            if types[0] == GGUFValueType.ARRAY:
                w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=types[-1])
            else:
                w.add_key_value(key, value, types[0])


class Vocabulary:
    """The embeddings and the output matrix, row by row (deterministic in the seed), for the cycle sigma over the
    good tokens `good` (all of them by default)."""

    def __init__(self, n_vocab: int, n_embd: int, agree, seed: int, good: np.ndarray | None = None,
                 run: int = 1024):
        self.n_vocab, self.n_embd, self.seed = n_vocab, n_embd, seed
        rates = (agree,) if isinstance(agree, (int, float)) else tuple(agree)
        self.n_a = n_embd - n_embd // B_FRACTION
        rng = np.random.default_rng(seed)
        self.good = np.arange(n_vocab) if good is None else np.asarray(good)
        is_good = np.zeros(n_vocab, dtype=bool)
        is_good[self.good] = True
        self.bias = not is_good.all()          # dimension 0 marks the tokens outside G (a real vocabulary)
        n_good = len(self.good)
        self.step = next(c for c in range(n_good // 3, n_good) if np.gcd(c, n_good) == 1)  # g_i -> g_{i+c}
        # the head's agreement along the cycle: rates[b] on the b-th run of `run` tokens in walk order (the order
        # greedy decoding visits them: g_0, g_c, g_2c, ...), the runs taking the rates in turn
        threshold = np.full(n_vocab, rates[0], dtype=np.float64)
        if len(rates) > 1:
            walk = np.arange(n_good) * pow(self.step, -1, n_good) % n_good   # g_i's position in walk order
            threshold[self.good] = np.asarray(rates)[walk // run % len(rates)]
        self.rates, self.run = rates, run
        self.in_d = (rng.random(n_vocab) >= threshold) & is_good     # the tokens the head mispredicts
        agreeing = np.flatnonzero(is_good & ~self.in_d)
        if len(agreeing) == 0:
            raise SystemExit("error: --agree leaves no token the head predicts right")
        # alias(x): an agreeing token other than x (a random one)
        self.alias = agreeing[rng.integers(0, len(agreeing), n_vocab)]
        self.alias[agreeing] = agreeing
        # source(x): the good token x behaves as (itself if good, else a random good one)
        self.source = np.arange(n_vocab)
        if self.bias:
            self.source[~is_good] = self.good[rng.integers(0, n_good, int((~is_good).sum()))]
        cycle_next = np.roll(self.good, -self.step)             # sigma(g_i) = g_{i + c mod |G|}
        self.sigma = np.empty(n_vocab, dtype=np.int64)
        self.sigma[self.good] = cycle_next
        self.sigma = self.sigma[self.source]
        self.before = np.full(n_vocab, -1, dtype=np.int64)      # the good x with sigma(x) = row, or -1
        self.before[cycle_next] = self.good

    @property
    def agreement(self) -> float:
        """The fraction of G the head predicts right."""
        return 1.0 - float(self.in_d[self.good].mean())

    def _base(self, tokens: np.ndarray) -> np.ndarray:
        """e_A(x): a standard normal vector on the first n_a dimensions, drawn per token."""
        out = np.zeros((len(tokens), self.n_embd), dtype=np.float32)
        for i, t in enumerate(tokens):
            out[i, :self.n_a] = np.random.default_rng((self.seed, int(t))).standard_normal(self.n_a)
        return out

    def embeddings(self, tokens: np.ndarray) -> np.ndarray:
        """e(x) = e_A(x), or e_A(alias(x)) + a part B_LENGTH times longer on the last dimensions for x in D; of
        source(x) for a token outside G; dimension 0 set to BIAS x |e_A| with a real vocabulary."""
        source = self.source[tokens]
        e = self._base(self.alias[source])
        for i in np.flatnonzero(self.in_d[source]):
            long = np.random.default_rng((self.seed, int(source[i]), 1)).standard_normal(self.n_embd - self.n_a)
            e[i, self.n_a:] = B_LENGTH * np.linalg.norm(e[i]) * long / np.linalg.norm(long)
        if self.bias:
            e[:, 0] = BIAS * np.linalg.norm(e[:, 1:self.n_a], axis=1)
        return e

    def output_rows(self, rows: np.ndarray, scale: float) -> np.ndarray:
        """Row sigma(x) = scale * e(x)/|e(x)| (without dimension 0) for x in G; (-BAD_ROW, 0, ...) for the rest."""
        x = self.before[rows]
        out = np.zeros((len(rows), self.n_embd), dtype=np.float32)
        ok = x >= 0
        e = self.embeddings(x[ok])
        if self.bias:
            e[:, 0] = 0.0
        out[ok] = scale * e / np.linalg.norm(e, axis=1, keepdims=True)
        out[~ok, 0] = -BAD_ROW
        return out


def default_scale(n_embd: int, n_good: int, p_top: float = 0.75, temperature: float = 0.8) -> float:
    """The logit scale s giving p(top) ~ p_top at a temperature: top logit s sqrt(n_embd), the other n_good - 1
    about s N(0, 1), so p = e^a / (e^a + (n_good - 1) e^(s^2 / 2T^2)) with a = s sqrt(n_embd) / T (bisection)."""
    lo, hi = 0.0, 10.0
    for _ in range(60):
        s = (lo + hi) / 2
        a = s * np.sqrt(n_embd) / temperature
        tail = np.log(n_good - 1) + s * s / (2 * temperature ** 2)
        lo, hi = (s, hi) if 1 / (1 + np.exp(tail - a)) < p_top else (lo, s)
    return round(lo, 3)


def quantized_matrix(make_rows, n_rows: int, n_cols: int, qtype: Q, probe=None) -> np.ndarray:
    """An (n_rows, n_cols) matrix built ROWS_PER_CHUNK rows at a time and quantized; probe(rows, block) sees each
    float block."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((n_rows, n_cols // block * type_size), dtype=np.uint8)
    for a in range(0, n_rows, ROWS_PER_CHUNK):
        rows = np.arange(a, min(a + ROWS_PER_CHUNK, n_rows))
        data = make_rows(rows)
        if probe is not None:
            probe(rows, data)
        out[a:a + len(rows)] = quantize(data, qtype)
    return out


def tensor_plan(p: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape, kind) of every tensor; kind: zero (Q4_K zeros), one / zero32 / neg (F32), or special."""
    n_embd, n_ff = p["n_embd"], p["n_ff"]
    key_dim, value_dim = p["d_state"] * p["n_group"], p["d_state"] * p["dt_rank"]
    q_dim, kv_dim = p["head_dim"] * p["n_head"], p["head_dim"] * p["n_head_kv"]
    plan = [("token_embd.weight", (n_embd, p["n_vocab"]), "embd"), ("output_norm.weight", (n_embd,), "one"),
            ("output.weight", (n_embd, p["n_vocab"]), "output")]
    n_all = p["n_layer"] + 1
    for il in range(n_all):
        blk = f"blk.{il}."
        plan += [(blk + "attn_norm.weight", (n_embd,), "one"), (blk + "post_attention_norm.weight", (n_embd,), "one")]
        if il < p["n_layer"] and (il + 1) % FULL_ATTENTION_INTERVAL != 0:   # gated delta-net
            plan += [(blk + "attn_qkv.weight", (n_embd, 2 * key_dim + value_dim), "zero"),
                     (blk + "attn_gate.weight", (n_embd, value_dim), "zero"),
                     (blk + "ssm_conv1d.weight", (4, 2 * key_dim + value_dim), "zero32"),
                     (blk + "ssm_dt.bias", (p["dt_rank"],), "zero32"), (blk + "ssm_a", (p["dt_rank"],), "neg"),
                     (blk + "ssm_beta.weight", (n_embd, p["dt_rank"]), "zero32"),
                     (blk + "ssm_alpha.weight", (n_embd, p["dt_rank"]), "zero32"),
                     (blk + "ssm_norm.weight", (p["d_state"],), "one"),
                     (blk + "ssm_out.weight", (value_dim, n_embd), "zero")]
        else:                                                                 # full attention (and the MTP block)
            plan += [(blk + "attn_q.weight", (n_embd, 2 * q_dim), "zero"),   # query and its output gate
                     (blk + "attn_k.weight", (n_embd, kv_dim), "zero"),
                     (blk + "attn_v.weight", (n_embd, kv_dim), "zero"),
                     (blk + "attn_output.weight", (q_dim, n_embd), "zero"),
                     (blk + "attn_q_norm.weight", (p["head_dim"],), "one"),
                     (blk + "attn_k_norm.weight", (p["head_dim"],), "one")]
        plan += [(blk + "ffn_gate.weight", (n_embd, n_ff), "zero"), (blk + "ffn_up.weight", (n_embd, n_ff), "zero"),
                 (blk + "ffn_down.weight", (n_ff, n_embd), "zero")]
        if il == p["n_layer"]:
            plan += [(blk + "nextn.eh_proj.weight", (2 * n_embd, n_embd), "eh_proj"),
                     (blk + "nextn.enorm.weight", (n_embd,), "enorm"), (blk + "nextn.hnorm.weight", (n_embd,), "one")]
    return plan


def write_metadata(w: GGUFWriter, p: dict, tokenizer: Tokenizer | None) -> None:
    a = ARCH
    w.add_name(f"synthetic {a} with an MTP head")
    for key, value, vtype in [
        ("context_length", 262144, GGUFValueType.UINT32), ("embedding_length", p["n_embd"], GGUFValueType.UINT32),
        ("block_count", p["n_layer"] + 1, GGUFValueType.UINT32), ("nextn_predict_layers", 1, GGUFValueType.UINT32),
        ("feed_forward_length", p["n_ff"], GGUFValueType.UINT32),
        ("attention.head_count", p["n_head"], GGUFValueType.UINT32),
        ("attention.head_count_kv", p["n_head_kv"], GGUFValueType.UINT32),
        ("attention.key_length", p["head_dim"], GGUFValueType.UINT32),
        ("attention.value_length", p["head_dim"], GGUFValueType.UINT32),
        ("attention.layer_norm_rms_epsilon", 1e-6, GGUFValueType.FLOAT32),
        ("full_attention_interval", FULL_ATTENTION_INTERVAL, GGUFValueType.UINT32),
        ("rope.dimension_count", p["rope_dim"], GGUFValueType.UINT32),
        ("rope.freq_base", 1e7, GGUFValueType.FLOAT32),
        ("ssm.conv_kernel", 4, GGUFValueType.UINT32), ("ssm.state_size", p["d_state"], GGUFValueType.UINT32),
        ("ssm.group_count", p["n_group"], GGUFValueType.UINT32),
        ("ssm.time_step_rank", p["dt_rank"], GGUFValueType.UINT32),
        ("ssm.inner_size", p["d_state"] * p["dt_rank"], GGUFValueType.UINT32),
    ]:
        w.add_key_value(f"{a}.{key}", value, vtype)
    w.add_key_value(f"{a}.rope.dimension_sections", list(p["sections"]), GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.INT32)
    if tokenizer is not None:
        tokenizer.write(w)
        return
    w.add_tokenizer_model("test")                       # llama.cpp's test vocabulary: no BOS/EOS, hashes any text
    w.add_token_list([f"tok_{i}" for i in range(p["n_vocab"])])
    w.add_token_scores([0.0] * p["n_vocab"])
    w.add_token_types([1] * p["n_vocab"])


def add_agree_args(ap: argparse.ArgumentParser, drafter: str) -> None:
    """--agree and --agree-run, as the synthetic files take them (`drafter`: what predicts the target)."""
    ap.add_argument("--agree", default="0.7",
                    help=f"fraction of the vocabulary {drafter} predicts right; a comma-separated list (0.95,0.7,0.3) "
                         "gives each run of --agree-run tokens along the cycle the next rate in turn: a greedy "
                         "answer stays in one run for up to that many tokens, so requests see different acceptance "
                         "(a mixed workload)")
    ap.add_argument("--agree-run", type=int, default=1024,
                    help="with a list of --agree rates: tokens of the cycle (in the order greedy decoding walks it) "
                         "per rate [1024]")


def agree_rates(ap: argparse.ArgumentParser, a: argparse.Namespace) -> list[float]:
    """The --agree rates, checked (with --agree-run): a bad one is the parser's one-line error."""
    try:
        rates = [float(x) for x in a.agree.split(",")]
    except ValueError:
        ap.error(f"--agree: {a.agree!r} is not a number or a comma-separated list of numbers")
    if not all(0.0 <= r <= 1.0 for r in rates) or max(rates) <= 0.0:
        ap.error("--agree: each rate in [0, 1], and one of them above 0")
    if a.agree_run < 1:
        ap.error("--agree-run must be at least 1")
    return rates


def agreement_said(drafter: str, vocab: "Vocabulary", a: argparse.Namespace, rates: list[float]) -> str:
    """The closing report's account of agreement: what the file has against what was asked."""
    runs = f" in runs of {a.agree_run}" if len(rates) > 1 else ""
    return f"{drafter} agreement {vocab.agreement:.3f} of {len(vocab.good)} good tokens (asked {a.agree}{runs})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    add_agree_args(ap, "the head")
    ap.add_argument("--scale", type=float, default=None,
                    help="output logit scale [default: p(top) ~ 0.75 at T=0.8: 0.15 at 27b, 0.47 at tiny with the "
                         "test vocabulary; solved for the good tokens with --vocab]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=Path, help="a vocab-only GGUF whose tokenizer the model takes (byte-level BPE: "
                    "llama.cpp's models/ggml-vocab-qwen35.gguf) [default: llama.cpp's test vocabulary]")
    ap.add_argument("--chat-template", type=Path, help="a Jinja file written as tokenizer.chat_template")
    ap.add_argument("--header-only", action="store_true",
                    help="write the header only, the tensor data a hole of its size (for header readers: check)")
    a = ap.parse_args()
    rates = agree_rates(ap, a)
    p = dict(PRESETS[a.preset])
    template = a.chat_template.read_text(encoding="utf-8") if a.chat_template is not None else None
    tokenizer = Tokenizer(a.vocab, p["n_vocab"], template) if a.vocab is not None else None
    if template is not None and tokenizer is None:
        ap.error("--chat-template needs --vocab (the test vocabulary has no special tokens to template with)")
    if tokenizer is not None:
        p["n_vocab"] = tokenizer.n_vocab
    good = tokenizer.good if tokenizer is not None else None
    if a.scale is not None:
        scale = a.scale
    elif tokenizer is not None:
        scale = default_scale(p["n_embd"], len(good))
    else:
        scale = 0.15 if a.preset == "27b" else 0.47
    t0 = time.perf_counter()
    vocab = Vocabulary(p["n_vocab"], p["n_embd"], rates[0] if len(rates) == 1 else rates, a.seed, good,
                       a.agree_run)

    # probe: the target's p(top) at T = 0.8 for a few tokens, from the output matrix as it is built
    probe_tokens = vocab.good[np.arange(0, len(vocab.good), max(1, len(vocab.good) // 16))[:16]]
    h = vocab.embeddings(probe_tokens)
    h *= np.sqrt(p["n_embd"]) / np.linalg.norm(h, axis=1, keepdims=True)      # rms_norm with unit weights
    logits = np.zeros((len(probe_tokens), p["n_vocab"]), dtype=np.float64)

    def probe(rows, block):
        logits[:, rows] = h @ block.T

    w = GGUFWriter(str(a.out), ARCH)
    write_metadata(w, p, tokenizer)
    plan = tensor_plan(p)
    q4_block, q4_size = GGML_QUANT_SIZES[Q.Q4_K]
    n_bytes = {}
    for name, shape, kind in plan:
        n = int(np.prod(shape))
        if kind == "zero":      # (the dtype only says "element shape", not bytes)
            n_bytes[name] = n // q4_block * q4_size
            w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), n_bytes[name], Q.Q4_K)
        elif kind in ("embd", "output", "eh_proj"):
            n_bytes[name] = n // 32 * 34
            w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), n_bytes[name], Q.Q8_0)
        else:
            n_bytes[name] = n * 4
            w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), n_bytes[name], Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if a.header_only:
        start = GGUFWriter.ggml_pad(w.fout[0].tell(), w.data_alignment)
        w.close()
        os.truncate(a.out, start + sum(GGUFWriter.ggml_pad(n, w.data_alignment) for n in n_bytes.values()))
        print(f"wrote the header of {a.out} ({a.out.stat().st_size / 2**30:.2f} GiB, a hole after the header)",
              file=sys.stderr)
        return
    zeros = np.zeros(max(int(np.prod(s)) for _, s, k in plan if k == "zero") // q4_block * q4_size, dtype=np.uint8)
    n_embd = p["n_embd"]
    for name, shape, kind in plan:
        n = int(np.prod(shape))
        if kind == "zero":
            data = zeros[:n // q4_block * q4_size]
        elif kind == "embd":
            data = quantized_matrix(vocab.embeddings, p["n_vocab"], n_embd, Q.Q8_0)
        elif kind == "output":
            data = quantized_matrix(lambda rows: vocab.output_rows(rows, scale), p["n_vocab"], n_embd, Q.Q8_0, probe)
        elif kind == "eh_proj":   # [I | 0]: output i reads input i (the normed token embedding), never the state
            data = quantized_matrix(lambda rows: np.eye(n_embd, 2 * n_embd, dtype=np.float32)[rows], n_embd,
                                    2 * n_embd, Q.Q8_0)
        elif kind == "enorm":   # the head does not see the D tokens' long part
            data = np.ones(n, dtype=np.float32)
            data[vocab.n_a:] = 0.0
        else:                   # norms 1, delta-net scalars 0, its decay rates (ssm_a) -1
            data = np.full(n, {"one": 1.0, "zero32": 0.0, "neg": -1.0}[kind], dtype=np.float32)
        w.write_tensor_data(data)
    w.close()

    z = logits / 0.8
    p_top = np.exp(z.max(axis=1) - np.logaddexp.reduce(z, axis=1))
    argmax_ok = np.mean(logits.argmax(axis=1) == vocab.sigma[probe_tokens])
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**30:.2f} GiB, {a.preset}) in {time.perf_counter() - t0:.0f} s: "
          f"{agreement_said('head', vocab, a, rates)}; the trunk's argmax is sigma(x) for "
          f"{100 * argmax_ok:.0f}% of probed tokens; p(top) at T=0.8: median "
          f"{np.median(p_top):.2f} (scale {scale})", file=sys.stderr)


if __name__ == "__main__":
    main()
