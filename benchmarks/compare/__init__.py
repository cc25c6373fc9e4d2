"""Comparisons: llamaspec against plain decoding and against its peers (llama.cpp's tools, llama-server)."""
