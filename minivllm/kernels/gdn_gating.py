"""The Gated DeltaNet's gates from its ``a`` and ``b`` projections, in one pass::

    g    = -exp(A_log) * softplus(a + dt_bias)    float32 (the delta rule's log decay)
    beta = sigmoid(b)                             in b's dtype (the write strength)

softplus as torch's: ``x`` above 20, else ``log(1 + exp(x))``. ``a`` and ``b`` are (T, H)
slices of the packed input projection (strided rows). Grid ``(cdiv(T, BLOCK_T),)``, each
program all H heads of BLOCK_T tokens.

Why a kernel: the reference is seven eager launches a DeltaNet layer (casts, exp, add,
softplus, multiply, sigmoid), 24 layers a step at Qwen3.5-9B's shapes.

Torch reference: :func:`minivllm.kernels.linear_attention_reference.gdn_gating_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SOFTPLUS_THRESHOLD = 20.0  # torch's default: softplus(x) = x above it
BLOCK_T = 16


@triton.jit
def _gdn_gating_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_tokens,
                       stride_a, stride_b, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]   # (BLOCK_T, 1)
    heads = tl.arange(0, BLOCK_H)[None, :]                                              # (1, BLOCK_H)
    mask = (rows < num_tokens) & (heads < H)
    a = tl.load(a_ptr + rows * stride_a + heads, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_b + heads, mask=mask, other=0.0)
    a_log = tl.load(a_log_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g_ptr + rows * H + heads, -tl.exp(a_log) * softplus, mask=mask)
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    tl.store(beta_ptr + rows * H + heads, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)``, each (T, H) contiguous: g float32, beta in b's dtype (module doc).

    Args:
        a, b: (T, H), last dimension contiguous (rows may be strided).
        a_log, dt_bias: (H,).

    Raises:
        TypeError: a tensor that is not bf16, fp16 or fp32.
        ValueError: shapes that disagree, a strided last dimension, or tensors on different devices.
    """
    for name, t in (("a", a), ("b", b), ("a_log", a_log), ("dt_bias", dt_bias)):
        check_dtype(name, t, _FLOAT_DTYPES)
    check_same_device(a=a, b=b, a_log=a_log, dt_bias=dt_bias)
    if a.dim() != 2 or b.shape != a.shape or a_log.shape != (a.shape[1],) or dt_bias.shape != a_log.shape:
        raise ValueError(f"gdn_gating: a and b (T, H), a_log and dt_bias (H,); got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, a_log {tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)}")
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("b", b)
    t, h = a.shape
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty(t, h, dtype=b.dtype, device=b.device)
    if t:
        _gdn_gating_kernel[(triton.cdiv(t, BLOCK_T),)](
            a, b, a_log.contiguous(), dt_bias.contiguous(), g, beta, t, a.stride(0), b.stride(0),
            H=h, BLOCK_T=BLOCK_T, BLOCK_H=next_pow2(h))
    return g, beta
