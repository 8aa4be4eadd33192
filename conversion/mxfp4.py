"""Plain-torch reference dequantizer for Kimi K3's MXFP4 routed experts (compressed-tensors `mxfp4-pack-quantized`).

Layout (docs/k3.md section 6; OCP Microscaling spec v1.0):
- `weight_packed` uint8 [out, in/2]: two E2M1 codes per byte along the INPUT (last) dim; the LOW nibble holds the
  even (earlier) column, the high nibble the odd column.
- E2M1 code: bit 3 = sign, bits 0-2 index the magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6].
- `weight_scale` uint8 [out, in/32]: E8M0 shared exponent per group of 32 input columns, factor 2**(byte - 127);
  byte 255 is NaN in the MX spec and is refused here.
- W[o, c] = E2M1(code[o, c]) * 2**(scale[o, c // 32] - 127).

Choice made by the converter: dequantize to bf16 (the model dtype). Every E2M1 value has at most 2 significant bits
and the factor is a power of two, so every product is exactly representable in bf16 (8 exponent bits like fp32;
the smallest product 0.5 * 2**-127 = 2**-128 is a bf16 subnormal, exact) as long as it does not overflow:
6 * 2**(s - 127) is finite for s <= 252. Bytes 253..255 (255 = NaN) are refused, so the dequantization is lossless.
The computation is done in fp32 and cast once. Keeping the packed form would need an MXFP4 matmul in the model (not on CPU); bf16 costs
4x the disk bytes of the packed experts.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class MXFP4Error(ValueError):
    pass


def e2m1_table(dtype=torch.float32) -> torch.Tensor:
    """The 16 E2M1 code values, indexed by the 4-bit code (sign bit 3)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype)
    return torch.cat([mags, -mags])


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     group_size: int = GROUP) -> torch.Tensor:
    """packed uint8 [out, in/2], scale uint8 [out, in/group] -> weight [out, in] in `dtype`.

    Raises MXFP4Error on dtype / shape mismatch or on a NaN (255) or overflowing (> 252) scale byte.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2:
        raise MXFP4Error(f"expected 2-D packed / scale, got {tuple(packed.shape)} / {tuple(scale.shape)}")
    out_f, half = packed.shape
    in_f = 2 * half
    if in_f % group_size or tuple(scale.shape) != (out_f, in_f // group_size):
        raise MXFP4Error(f"scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                         f"(expected [{out_f}, {in_f // group_size}])")
    if scale.numel():
        hi = int(scale.max())
        if hi == 255:
            raise MXFP4Error("E8M0 scale byte 255 (NaN) found")
        if hi > 252:
            raise MXFP4Error(f"E8M0 scale byte {hi} overflows the float range (6 * 2**{hi - 127})")
    lo_codes = packed & 0x0F
    hi_codes = packed >> 4
    codes = torch.stack([lo_codes, hi_codes], dim=-1).reshape(out_f, in_f)  # even column = low nibble
    vals = e2m1_table()[codes.long()]  # fp32 [out, in]
    exps = scale.to(torch.int32) - 127
    factor = torch.exp2(exps.to(torch.float32))  # exact powers of two for |exp| <= 127
    vals = vals.view(out_f, in_f // group_size, group_size) * factor.unsqueeze(-1)
    return vals.reshape(out_f, in_f).to(dtype)
