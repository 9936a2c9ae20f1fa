"""Format constants of NVFP4 (E2M1 elements, E4M3 block scales, FP32 tensor scale).

All values are plain Python numbers; nothing here allocates tensors.
"""

from __future__ import annotations

#: Magnitudes of FP4 E2M1 by 3-bit index 0..7. Code = sign << 3 | index.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Largest E2M1 magnitude.
E2M1_MAX: float = 6.0
#: Bit that carries the sign in an E2M1 code.
E2M1_SIGN_BIT: int = 0x8

#: Largest finite FP8 E4M3 (``torch.float8_e4m3fn``) value.
E4M3_MAX: float = 448.0
#: Smallest normal and smallest subnormal E4M3 values.
E4M3_MIN_NORMAL: float = 2.0**-6
E4M3_MIN_SUBNORMAL: float = 2.0**-9

#: NVFP4 block size along the last (K, reduction) dimension.
BLOCK_SIZE: int = 16
#: Numerator of the ENCODE-form global scale: ``global_scale = 2688 / amax``.
GLOBAL_SCALE_NUMERATOR: float = E4M3_MAX * E2M1_MAX

#: compressed-tensors replaces a zero block scale by the E4M3 "eps" 0.125.
CT_ZERO_SCALE_REPLACEMENT: float = 0.125

#: Swizzled ("blocked") scale layout tile: 128 rows by 4 scale columns, 512 bytes.
SWIZZLE_ROWS: int = 128
SWIZZLE_COLS: int = 4

#: GGUF / ggml NVFP4 (ggml type 40): elements per block and bytes per block (4 UE4M3 scale
#: bytes, one per 16 elements, then 32 bytes of codes); ggml-common.h ``block_nvfp4``.
GGML_NVFP4_BLOCK: int = 64
GGML_NVFP4_BLOCK_BYTES: int = 36

#: ggml Q8_0 (ggml type 8): values per block (int8 codes and one fp16 scale; ggml-common.h
#: ``block_q8_0``, 34 bytes): what llama.cpp's CPU path quantizes activations to for NVFP4.
GGML_Q8_0_BLOCK: int = 32
