"""Tiny models with a multi-token-prediction (MTP, "nextn") head, for tests.

The trunk is a test-llama-archs model (arch_models.py); `add_mtp_block` appends one nextn block after it with the
gguf package: the tensors the arch's loader asks for (`load_block_mtp` in llama.cpp's src/models/<arch>.cpp) are
the ones of the trunk's last block (a full-attention block in qwen35/qwen35moe/glm4moe) plus
`nextn.eh_proj` {2*n_embd, n_embd}, `nextn.enorm` and `nextn.hnorm`; the metadata says
`<arch>.nextn_predict_layers = 1` and `<arch>.block_count` counts the extra block.

A random head drafts badly. `head="agree"` builds one that predicts what the trunk would: the MTP block's attention
output and FFN down projections are zero, so the block passes its input through, and eh_proj = [I | 0] takes only
the token-embedding half of concat(enorm(e), hnorm(h)), with enorm = 1. Its logits are then
output(output_norm(rms(e(x)))), exactly the trunk's logits when the trunk's own mixing is off (`trunk_mix=0`: the
trunk's attention, delta-net and FFN output projections scaled to zero, so the next token depends only on the
current one). `trunk_mix` between 0 and 1 brings the context back, and with it disagreement: the head proposes
f(x) while the trunk says f(x) + the context's contribution.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from .arch_models import make_arch_model

# projections that write into the residual stream: scaling them by trunk_mix scales the context's contribution
_MIXING = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
           "ffn_down_shexp.weight")

# archs whose MTP graph ropes without sections: test-llama-archs gives every model M-RoPE sections, so the trunk
# would use M-RoPE and the head would trip ggml's rope assertion; such files lose the sections (plain RoPE)
_NO_MROPE_HEAD = ("glm4moe",)


def add_mtp_block(src: str | os.PathLike, dst: str | os.PathLike, head: str = "random", stdev: float = 0.5,
                  trunk_mix: float = 1.0, seed: int = 7) -> Path:
    """Write `dst`: the model `src` with one nextn block appended (see the module docstring)."""
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n_layer = r.fields[f"{arch}.block_count"].contents()
    n_embd = r.fields[f"{arch}.embedding_length"].contents()
    il = n_layer                                         # the MTP block comes right after the trunk
    w = GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == GGUFValueType.ARRAY and len(field.types) < 2:
            continue                                     # an empty array has no element type to copy
        if key == f"{arch}.rope.dimension_sections" and arch in _NO_MROPE_HEAD:
            continue
        value = field.contents()
        if key == f"{arch}.block_count":
            value = n_layer + 1
        elif key == f"{arch}.nextn_predict_layers":
            value = 1
        elif key == f"{arch}.attention.recurrent_layers" and isinstance(value, list):
            value = value + [0]                          # one entry per block; the MTP block is attention
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)

    last = f"blk.{n_layer - 1}."
    template = []
    for t in r.tensors:
        data = np.array(t.data)
        if t.name.startswith("blk.") and t.name.endswith(_MIXING):
            data = (data * trunk_mix).astype(data.dtype)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        if t.name.startswith(last) and not t.name.endswith("scale"):   # .scale/.input_scale: optional, left out
            template.append((t.name[len(last):], data.shape))

    rng = np.random.default_rng(seed)
    for name, shape in template:
        data = (rng.standard_normal(shape) * stdev).astype(np.float32)
        if head == "agree" and name.endswith(_MIXING):
            data[...] = 0.0                              # the block passes eh_proj's output through
        w.add_tensor(f"blk.{il}.{name}", data)
    eh_proj = (rng.standard_normal((n_embd, 2 * n_embd)) * stdev).astype(np.float32)  # numpy order: (out, in)
    enorm = (rng.standard_normal(n_embd) * stdev).astype(np.float32)
    if head == "agree":
        eh_proj[:, :] = 0.0
        eh_proj[:, :n_embd] = np.eye(n_embd, dtype=np.float32)         # [I | 0]: the token-embedding half
        enorm[:] = 1.0
    elif head != "random":
        raise ValueError(f"head must be 'random' or 'agree', got {head!r}")
    w.add_tensor(f"blk.{il}.nextn.eh_proj.weight", eh_proj)
    w.add_tensor(f"blk.{il}.nextn.enorm.weight", enorm)
    w.add_tensor(f"blk.{il}.nextn.hnorm.weight", (rng.standard_normal(n_embd) * stdev).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def make_mtp_model(arch: str, out_dir: str | os.PathLike, head: str = "random", trunk_mix: float = 1.0,
                   seed: int = 1, stdev: float = 0.5) -> Path:
    """A test-llama-archs `arch` model (seed, stdev) with an MTP head appended; cached in out_dir. Skips the test
    when test-llama-archs is absent."""
    out = Path(out_dir) / f"{arch}-mtp-{head}-m{trunk_mix:g}-s{seed}-d{stdev:g}.gguf"
    if not out.exists():
        trunk = make_arch_model(arch, out_dir, seed=seed, stdev=stdev)
        part = out.with_suffix(".partial")
        add_mtp_block(trunk, part, head=head, stdev=stdev, trunk_mix=trunk_mix)
        part.rename(out)
    return out


def split_mtp_head(src: str | os.PathLike, trunk_dst: str | os.PathLike, head_dst: str | os.PathLike) -> None:
    """Split a model with one MTP block (the file's last) the way ggml-org ships such models: `trunk_dst`, the model
    without the block (nextn_predict_layers 0), and `head_dst`, the head alone (the block, the token embeddings and
    the output norm and head; the header as the source's, so block_count still counts the trunk's blocks)."""
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n_layer = r.fields[f"{arch}.block_count"].contents()
    head = f"blk.{n_layer - 1}."
    for dst, is_head in ((trunk_dst, False), (head_dst, True)):
        w = GGUFWriter(str(dst), arch)
        for key, field in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if field.types[0] == GGUFValueType.ARRAY and len(field.types) < 2:
                continue
            value = field.contents()
            if not is_head:
                if key == f"{arch}.block_count":
                    value = n_layer - 1
                elif key == f"{arch}.nextn_predict_layers":
                    value = 0
                elif key == f"{arch}.attention.recurrent_layers" and isinstance(value, list):
                    value = value[:-1]
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, value, field.types[0], sub_type=sub)
        for t in r.tensors:
            in_head = t.name.startswith(head) or not t.name.startswith("blk.")
            if (in_head if is_head else not t.name.startswith(head)):
                w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
