"""The oracles: slow, readable arithmetic written independently of the fast path, from each
format's and each engine's source, that the tests compare the fast path with bit for bit.

They import nothing from the package outside this folder (a rule: an oracle that shared code
with what it checks could share its mistakes). One module per job:

================  ===============================================================================
``numbers``       float32 / bfloat16 / float16 rounding, E2M1 and E4M3 codes, nibble packing
``nvfp4``         NVFP4 block quantization and decode in each arithmetic order, the tensor scale,
                  the swizzled scale offset
``kv_cache``      the KV cache as vLLM 0.33 writes and reads it (nvfp4, nvfp4_4over6, fp8)
``ggml``          llama.cpp's CPU arithmetic: Q8_0 activations and the NVFP4 x Q8_0 dot
================  ===============================================================================

``nvfp4lab.reference`` (``numbers`` + ``nvfp4`` + ``kv_cache``) and ``nvfp4lab.reference_ggml``
(``ggml``) are the deprecated names of these modules, kept for one release.
"""
