"""llama.cpp's architectures by what their graph builders assert (src/models/*.cpp), as data for limits.py."""
from __future__ import annotations

# What the graph builders of src/models/*.cpp assert at their top (tests/support/llama_asserts.py derives these lists from
# a llama.cpp source tree, and a test keeps them in step): the key and value head sizes are equal; the rotary
# dimension is the head size; the query projection is {n_embd, n_embd}, so the heads must tile n_embd exactly.
HEAD_K_EQ_V_ARCHS = frozenset("""
afmoe apertus arcee arctic baichuan bailingmoe2 bert bitnet bloom chameleon chatglm codeshell cogvlm
cohere2 cohere2moe command-r dbrx deci deepseek dots1 dream ernie4_5 ernie4_5-moe eurobert exaone
exaone-moe exaone4 falcon glm4 glm4moe gpt2 gptneox granite granite_swa granitehybrid graniteswitch
grok grovemoe hunyuan-moe hunyuan_vl hy_v3 internlm2 jais jais2 laguna lfm2 lfm2moe llada llada-moe
llama llama4 maincoder maple mellum minimax-01 minimax-m2 minimax-m3 mistral3 modern-bert mpt
muse-glimmer nanbeige nemotron nemotron_h neo-bert olmo olmo2 olmoe openelm orion paddleocr
pangu-embedded phi2 phi3 plamo pockettts qwen qwen2 qwen2moe qwen2vl qwen3 qwen35 qwen35moe qwen3moe
qwen3vl qwen3vlmoe refact rnd1 seed_oss smallthinker smollm3 spark2_5 stablelm starcoder starcoder2
t5 talkie xverse""".split())
HEAD_IS_ROT_ARCHS = frozenset("""
apertus arcee arctic baichuan chameleon codeshell cogvlm cohere2moe dbrx deci deepseek dots1 dream
ernie4_5 ernie4_5-moe exaone exaone-moe exaone4 falcon granite granite_swa graniteswitch grok
grovemoe hunyuan-moe hunyuan_vl hy_v3 internlm2 jais2 llada llada-moe llama llama4 maincoder mellum
minimax-01 minimax-m2 mistral3 nemotron olmo olmo2 olmoe orion paddleocr pangu-embedded plamo
pockettts qwen2 qwen2moe qwen2vl qwen3 qwen3moe qwen3vl qwen3vlmoe rnd1 seed_oss smallthinker
smollm3 starcoder2 talkie xverse""".split())
QUERY_IS_N_EMBD_ARCHS = frozenset("""
arctic baichuan bert bitnet chameleon codeshell cohere2 command-r deepseek deepseek2-ocr dream
eurobert grok internlm2 jamba jina-bert-v2 jina-bert-v3 lfm2 lfm2moe llada-moe nemotron nomic-bert
nomic-bert-moe olmo olmo2 olmoe orion phi2 phi3 phimoe plamo pockettts qwen2 qwen2moe qwen2vl
stablelm starcoder2 xverse""".split())
