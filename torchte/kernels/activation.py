"""Activations of LayerNormMLP, forward and backward, in one pass over x.

Shapes: x (M, K), contiguous (leading dims are allowed: (..., K)), fp32 / bf16 / fp16. Gated
activations split x along its last dim into x1 = x[:, :N] and x2 = x[:, N:] (K = 2N) and return
act(x1) * x2, so y and dy are (M, N) and dx is (M, 2N); the others act elementwise (N = K).
y and dx have x's dtype; dy may be any of the three; the math runs in fp32.

Definitions follow Transformer Engine, so that checkpoints carry over:
  gelu(x)  = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (the tanh approximation)
  qgelu(x) = x sigmoid(1.702 x)       relu(x) = max(x, 0)       srelu(x) = relu(x)^2
  silu(x)  = x sigmoid(x)
  geglu, qgeglu, reglu, sreglu, swiglu: gelu, qgelu, relu, srelu, silu of x1, times x2.
  glu: sigmoid(x1) x2. The sigmoid is of the first half, as in Transformer Engine; note that
  torch.nn.functional.glu gates the other way round (x1 sigmoid(x2)).
  clamped_swiglu (GPT-OSS): x1c = min(x1, limit), x2c = clamp(x2, -limit, limit),
  y = x1c sigmoid(alpha x1c) (x2c + 1); no gradient flows where a clamp is active (x1 > limit,
  |x2| > limit). `limit` and `alpha` are used by clamped_swiglu only (qgelu's 1.702 is fixed).
The derivative of relu (and srelu) at 0 is 0, as in torch and Transformer Engine.

gelu is computed as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): 0.5 (1 + tanh(u)) equals
sigmoid(2u), which needs one exp and has no cancellation in 1 + tanh(u) for negative x.

On CUDA with Triton one kernel runs per call (none when x is empty); elsewhere the torch
reference below, the same function in fp32 torch ops.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from ._compile import compiled_as_op
from ._triton import FastLaunch, triton_available

# name -> (the activation applied to x (or x1), gated)
_SPECS: dict[str, tuple[str, bool]] = {
    "gelu": ("gelu", False),
    "geglu": ("gelu", True),
    "glu": ("sigmoid", True),
    "qgelu": ("qgelu", False),
    "qgeglu": ("qgelu", True),
    "relu": ("relu", False),
    "reglu": ("relu", True),
    "srelu": ("srelu", False),
    "sreglu": ("srelu", True),
    "silu": ("silu", False),
    "swiglu": ("silu", True),
    "clamped_swiglu": ("clamped_silu", True),
}
ACTIVATIONS: tuple[str, ...] = tuple(_SPECS)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

GELU_C = 0.7978845608028654  # sqrt(2 / pi)
GELU_B = 0.044715
QGELU_ALPHA = 1.702

# (elements per program, num_warps). A gated tile is (TILE // BLOCK_N, BLOCK_N) with BLOCK_N
# the power of two that covers N (at most TILE); a non-gated x is walked as one flat vector.
# Not yet tuned on a GPU: benchmarks/activation.py sweeps these.
FORWARD_CONFIG = (4096, 8)
BACKWARD_CONFIG = (4096, 8)
MIN_BLOCK = 32

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference runs
    triton = None

if triton is not None:
    # On the GPU the sigmoid's exp and reciprocal are single approximate instructions
    # (ex2.approx.ftz, rcp.approx.ftz: about 2 ulp and 1 ulp, where tl.exp and the division
    # also approximate but add range fixups: 8 instructions a value instead of 2). Under
    # Triton's CPU interpreter, which runs no inline assembly, tl.exp and the division.
    _FAST_MATH = tl.constexpr(not triton.knobs.runtime.interpret)

    @triton.jit
    def _exp_neg_abs(v):
        """exp(-|v|) of fp32 v, in (0, 1]; values below 2**-126 flushed to 0 on the GPU."""
        if _FAST_MATH:
            return tl.inline_asm_elementwise(
                "ex2.approx.ftz.f32 $0, $1;", "=r,r", [-tl.abs(v) * 1.4426950408889634],
                dtype=tl.float32, is_pure=True, pack=1,
            )  # fmt: skip
        return tl.exp(-tl.abs(v))

    @triton.jit
    def _reciprocal(d):
        """1 / d of fp32 d in [1, 2]."""
        if _FAST_MATH:
            return tl.inline_asm_elementwise(
                "rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32, is_pure=True,
                pack=1,
            )  # fmt: skip
        return 1.0 / d

    @triton.jit
    def _sigmoid(v):
        """(sigmoid(v), 1 - sigmoid(v)) of fp32 v, each to a few ulp.

        With e = exp(-|v|) in [0, 1], the two are 1 / (1 + e) and e / (1 + e), in the order
        v's sign gives: no exp overflows to inf (so no 1 / inf, whose value GPU division
        does not promise) and 1 - s is never a cancelling difference, whose error the x s (1 - s)
        terms of the derivatives would scale up (GPU exp and division are not correctly
        rounded)."""
        e = _exp_neg_abs(v)
        r = _reciprocal(1.0 + e)
        p = e * r
        return tl.where(v >= 0.0, r, p), tl.where(v >= 0.0, p, r)

    @triton.jit
    def _act_and_grad(a, limit, alpha, ACT: tl.constexpr):
        """(act(a), act'(a)) of fp32 a for ACT in gelu, qgelu, relu, srelu, silu, sigmoid,
        clamped_silu (x1c sigmoid(alpha x1c), x1c = min(a, limit)); the unused one is compiled
        away."""
        if ACT == "gelu":
            # 2u = a (2c + 2cb a^2) and d(2u)/da = 2c + 6cb a^2 (c = sqrt(2/pi), b = 0.044715),
            # so act' = s + a s (1 - s) d(2u)/da: a^2 once, two multiply-adds.
            a2 = a * a
            s, sc = _sigmoid(a * (1.5957691216057308 + 0.07135481627260025 * a2))
            t = s * sc
            # t is 0 exactly where |a| is so large that a * a may overflow: avoid 0 * inf.
            slope = t * (a * (1.5957691216057308 + 0.21406444881780076 * a2))
            act = a * s
            dact = s + tl.where(t == 0.0, 0.0, slope)
        elif ACT == "qgelu":
            s, sc = _sigmoid(1.702 * a)
            act = a * s
            dact = s + 1.702 * a * s * sc
        elif ACT == "relu":
            act = tl.where(a < 0.0, 0.0, a)  # comparisons let NaN through, as torch.relu
            dact = tl.where(a > 0.0, 1.0, 0.0)
        elif ACT == "srelu":
            r = tl.where(a < 0.0, 0.0, a)
            act = r * r
            dact = 2.0 * r
        elif ACT == "silu":
            s, sc = _sigmoid(a)
            act = a * s
            dact = s + a * s * sc
        elif ACT == "sigmoid":
            act, sc = _sigmoid(a)
            dact = act * sc
        else:  # clamped_silu
            ac = tl.where(a > limit, limit, a)
            s, sc = _sigmoid(alpha * ac)
            act = ac * s
            dact = tl.where(a <= limit, s + alpha * ac * s * sc, 0.0)
        return act, dact

    @triton.jit
    def _gate(g, limit, ACT: tl.constexpr):
        """The factor x2 enters y with: x2 itself, or clamp(x2, -limit, limit) + 1."""
        if ACT == "clamped_silu":
            g = tl.where(g > limit, limit, tl.where(g < -limit, -limit, g)) + 1.0
        return g

    @triton.jit
    def _tile_offsets(
        rows, cols, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """(x offsets, y offsets, mask), (BLOCK_M, BLOCK_N) each, of this program's tile.

        Gated: x is (rows, 2 cols) and y (rows, cols); program p takes row block p // col_blocks
        and column block p % col_blocks. Not gated: x and y are one flat vector of cols
        elements (the launcher passes rows = 1, BLOCK_M = 1) and program p takes block p.
        """
        pid = tl.program_id(0)
        if GATED:
            col_blocks = tl.cdiv(cols, BLOCK_N)
            pid_m = pid // col_blocks
            pid_n = pid - pid_m * col_blocks
            r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            c = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (r < rows)[:, None] & (c < cols)[None, :]
            r64 = r.to(tl.int64)[:, None]
            y_offs = r64 * cols + c[None, :]
            x_offs = r64 * cols * 2 + c[None, :]
        else:
            c = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (c < cols)[None, :]
            y_offs = c[None, :]
            x_offs = y_offs
        return x_offs, y_offs, mask

    @triton.jit
    def _forward_kernel(
        x_ptr,  # (M, 2N) when GATED else (M, N); fp32 / bf16 / fp16, contiguous
        y_ptr,  # (M, N), x's dtype
        rows,  # M when GATED, else 1
        cols,  # N when GATED, else M * N
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        ACT: tl.constexpr,  # gelu, qgelu, relu, srelu, silu, sigmoid, clamped_silu
        GATED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        x_offs, y_offs, mask = _tile_offsets(rows, cols, GATED, BLOCK_M, BLOCK_N)
        a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        y, _ = _act_and_grad(a, limit, alpha, ACT)
        if GATED:
            g = tl.load(x_ptr + x_offs + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * _gate(g, limit, ACT)
        tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(
        dy_ptr,  # (M, N); fp32 / bf16 / fp16, contiguous
        x_ptr,  # (M, 2N) when GATED else (M, N); fp32 / bf16 / fp16, contiguous
        dx_ptr,  # like x, x's dtype
        rows,  # M when GATED, else 1
        cols,  # N when GATED, else M * N
        limit,  # fp32; clamped_silu only
        alpha,  # fp32; clamped_silu only
        ACT: tl.constexpr,  # gelu, qgelu, relu, srelu, silu, sigmoid, clamped_silu
        GATED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        x_offs, y_offs, mask = _tile_offsets(rows, cols, GATED, BLOCK_M, BLOCK_N)
        dy = tl.load(dy_ptr + y_offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        act, dact = _act_and_grad(a, limit, alpha, ACT)
        out_ty = dx_ptr.dtype.element_ty
        if GATED:
            g = tl.load(x_ptr + x_offs + cols, mask=mask, other=0.0).to(tl.float32)
            dx1 = dy * dact * _gate(g, limit, ACT)
            dx2 = dy * act
            if ACT == "clamped_silu":
                dx2 = tl.where((g >= -limit) & (g <= limit), dx2, 0.0)
            tl.store(dx_ptr + x_offs, dx1.to(out_ty), mask=mask)
            tl.store(dx_ptr + x_offs + cols, dx2.to(out_ty), mask=mask)
        else:
            tl.store(dx_ptr + x_offs, (dy * dact).to(out_ty), mask=mask)

    _launch_forward = FastLaunch(_forward_kernel)
    _launch_backward = FastLaunch(_backward_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------


def is_gated(name: str) -> bool:
    """True for the activations that split x in two (geglu, glu, qgeglu, reglu, sreglu, swiglu,
    clamped_swiglu); ValueError for an unknown name."""
    return _spec(name)[1]


@compiled_as_op("(Tensor x, str name, float limit=7.0, float alpha=1.702) -> Tensor")
def activation_forward(
    x: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """y = name(x): x (M, K) -> y (M, N) in x's dtype (N = K / 2 when gated, else K)."""
    if name not in _SPECS:
        _unknown(name)
    if x.is_cuda and triton_available():
        return _forward_triton(x, name, limit, alpha)
    return activation_forward_reference(x, name, limit, alpha)


@compiled_as_op("(Tensor dy, Tensor x, str name, float limit=7.0, float alpha=1.702) -> Tensor")
def activation_backward(
    dy: torch.Tensor, x: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """dx = dy * d name(x) / dx: dy (M, N), x (M, K) -> dx (M, K) in x's dtype."""
    if name not in _SPECS:
        _unknown(name)
    if x.is_cuda and triton_available():
        return _backward_triton(dy, x, name, limit, alpha)
    return activation_backward_reference(dy, x, name, limit, alpha)


def _spec(name: str) -> tuple[str, bool]:
    spec = _SPECS.get(name)
    if spec is None:
        _unknown(name)
    return spec


def _unknown(name) -> NoReturn:
    raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")


def _out_cols(x: torch.Tensor, gated: bool, name: str) -> int:
    """N, the width of y, after checking x's dtype and shape (before any kernel runs)."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: x must have at least one dim, got a scalar")
    k = x.shape[-1]
    if gated:
        if k % 2:
            raise ValueError(f"{name}: x's last dim must be even (x1, x2 halves), got {k}")
        return k // 2
    return k


def _check_dy(dy: torch.Tensor, x: torch.Tensor, n: int, name: str) -> None:
    if dy.dtype not in _DTYPES:
        raise TypeError(f"{name}: dy must be float32, bfloat16 or float16, got {dy.dtype}")
    if dy.dim() != x.dim() or dy.shape[:-1] != x.shape[:-1] or dy.shape[-1] != n:
        want, got = (*x.shape[:-1], n), tuple(dy.shape)
        raise ValueError(f"{name}: dy must have shape {want} for x {tuple(x.shape)}, got {got}")
    if dy.device != x.device:
        raise ValueError(f"{name}: dy is on {dy.device}, x on {x.device}")


def _tile(rows: int, cols: int, gated: bool, config: tuple[int, int]) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the launch (rows, cols as the kernels take them)."""
    tile, num_warps = config
    block_n = min(max(1 << (cols - 1).bit_length(), MIN_BLOCK), tile)
    block_m = tile // block_n if gated else 1
    return block_m, block_n, max(1, min(num_warps, block_m * block_n // 256))


def _forward_triton(
    x: torch.Tensor,
    name: str,
    limit: float,
    alpha: float,
    config: tuple[int, int] = FORWARD_CONFIG,
) -> torch.Tensor:
    """Launch _forward_kernel: x (M, K) -> y (M, N); no launch when y is empty."""
    act, gated = _SPECS[name]
    n = _out_cols(x, gated, name)
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    numel = y.numel()
    if numel == 0:
        return y
    rows, cols = (numel // n, n) if gated else (1, numel)
    block_m, block_n, num_warps = _tile(rows, cols, gated, config)
    grid = (-(-rows // block_m) * -(-cols // block_n), 1, 1)
    key = (
        x.dtype, act, gated, block_m, block_n, num_warps,
        rows == 1, rows & 15, rows >> 31, cols == 1, cols & 15, cols >> 31,
        x.data_ptr() & 15, y.data_ptr() & 15,
    )  # fmt: skip
    _launch_forward(
        key, grid, num_warps, x, y, rows, cols, float(limit), float(alpha), act, gated,
        block_m, block_n,
    )  # fmt: skip
    return y


def _backward_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    name: str,
    limit: float,
    alpha: float,
    config: tuple[int, int] = BACKWARD_CONFIG,
) -> torch.Tensor:
    """Launch _backward_kernel: dy (M, N), x (M, K) -> dx (M, K); no launch when x is empty."""
    act, gated = _SPECS[name]
    n = _out_cols(x, gated, name)
    _check_dy(dy, x, n, name)
    if not x.is_contiguous():
        x = x.contiguous()
    if not dy.is_contiguous():
        dy = dy.contiguous()
    dx = torch.empty_like(x)
    numel = dy.numel()
    if numel == 0:
        return dx
    rows, cols = (numel // n, n) if gated else (1, numel)
    block_m, block_n, num_warps = _tile(rows, cols, gated, config)
    grid = (-(-rows // block_m) * -(-cols // block_n), 1, 1)
    key = (
        x.dtype, dy.dtype, act, gated, block_m, block_n, num_warps,
        rows == 1, rows & 15, rows >> 31, cols == 1, cols & 15, cols >> 31,
        dy.data_ptr() & 15, x.data_ptr() & 15, dx.data_ptr() & 15,
    )  # fmt: skip
    _launch_backward(
        key, grid, num_warps, dy, x, dx, rows, cols, float(limit), float(alpha), act, gated,
        block_m, block_n,
    )  # fmt: skip
    return dx


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def _sigmoid_grad(v: torch.Tensor, a: torch.Tensor, alpha: float) -> torch.Tensor:
    """d/da of a sigmoid(alpha a), given v = alpha a; 1 - sigmoid(v) is taken as sigmoid(-v),
    which does not cancel where sigmoid(v) is near 1."""
    s = torch.sigmoid(v)
    return s + alpha * a * s * torch.sigmoid(-v)


def _act_and_grad_reference(
    a: torch.Tensor, act: str, limit: float, alpha: float, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(act(a), act'(a) or None) of fp32 a; `act` as in _SPECS' values."""
    dact = None
    if act == "gelu":
        v = 2.0 * GELU_C * (a + GELU_B * a * a * a)
        s = torch.sigmoid(v)
        y = a * s
        if want_grad:
            t = 2.0 * s * torch.sigmoid(-v)
            slope = a * t * GELU_C * (1.0 + 3.0 * GELU_B * a * a)
            dact = s + torch.where(t == 0.0, 0.0, slope)  # no 0 * inf for huge |a|
    elif act in ("qgelu", "silu"):
        k = QGELU_ALPHA if act == "qgelu" else 1.0
        y = a * torch.sigmoid(k * a)
        dact = _sigmoid_grad(k * a, a, k) if want_grad else None
    elif act == "relu":
        y = torch.where(a < 0.0, 0.0, a)
        dact = torch.where(a > 0.0, 1.0, 0.0) if want_grad else None
    elif act == "srelu":
        r = torch.where(a < 0.0, 0.0, a)
        y = r * r
        dact = 2.0 * r if want_grad else None
    elif act == "sigmoid":
        y = torch.sigmoid(a)
        dact = y * torch.sigmoid(-a) if want_grad else None  # 1 - s as sigmoid(-a): no cancelling
    else:  # clamped_silu
        ac = torch.where(a > limit, limit, a)
        y = ac * torch.sigmoid(alpha * ac)
        if want_grad:
            dact = torch.where(a <= limit, _sigmoid_grad(alpha * ac, ac, alpha), 0.0)
    return y, dact


def _gate_reference(g: torch.Tensor, act: str, limit: float) -> torch.Tensor:
    """The factor x2 (fp32) enters y with: x2 itself, or clamp(x2, -limit, limit) + 1."""
    if act == "clamped_silu":
        return torch.where(g > limit, limit, torch.where(g < -limit, -limit, g)) + 1.0
    return g


def activation_forward_reference(
    x: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """Torch reference of activation_forward: x (M, K) -> y (M, N), x's dtype, fp32 math."""
    act, gated = _spec(name)
    n = _out_cols(x, gated, name)
    x_f32 = x.float()
    y, _ = _act_and_grad_reference(x_f32[..., :n], act, limit, alpha, False)
    if gated:
        y = y * _gate_reference(x_f32[..., n:], act, limit)
    return y.to(x.dtype)


def activation_backward_reference(
    dy: torch.Tensor, x: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """Torch reference of activation_backward: dy (M, N), x (M, K) -> dx (M, K), x's dtype."""
    act, gated = _spec(name)
    n = _out_cols(x, gated, name)
    _check_dy(dy, x, n, name)
    x_f32, dy_f32 = x.float(), dy.float()
    y, dact = _act_and_grad_reference(x_f32[..., :n], act, limit, alpha, True)
    if not gated:
        return (dy_f32 * dact).to(x.dtype)
    g = x_f32[..., n:]
    dx1 = dy_f32 * dact * _gate_reference(g, act, limit)
    dx2 = dy_f32 * y
    if act == "clamped_silu":
        dx2 = torch.where((g >= -limit) & (g <= limit), dx2, 0.0)
    return torch.cat([dx1, dx2], dim=-1).to(x.dtype)
