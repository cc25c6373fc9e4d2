"""GGUF files without llama.cpp: the header reader (`reader`: metadata, tensors, the pair check), the field-by-field
compatibility report (`compat`), the editor behind convert/ (`edit`), and the memory plan (`memory`: weights, KV
cache, recurrent state and compute buffers against a GPU's size). Nothing here loads weights or decodes."""
