"""The tile bodies of the block-scaled FP8 casts (kernels/block_cast.py): Triton device
functions that read a 128 x 128 tile once, as four slices of 32 rows (rows 4i + k), and write
its 1x128 (rows and columns) or 128x128 casts, with the scales and their helpers. The kernels,
their launchers and the layouts are in block_cast.py; the torch reference of the same bytes in
block_cast_reference.py.

Scales follow block_cast_reference.block_scale_reference bit for bit; power-of-2 scales come
from the amax's exponent bits without a division, the others (and the scale_inv) from
divisions of significands that need no slow path (div.rn.f32's is a call, across which a
tile's values would stay live in twice the registers). FP8 bytes come from the GPU's conversion
instruction (cvt.rn.satfinite, which saturates as the reference's clamp does), bitcast to
integers at once; under Triton's CPU interpreter, which mis-rounds that conversion, from
_fp8_codec's integer encoder. The columnwise bytes of rows 4i..4i+3 pack into one int32 word,
and the transposed store moves 32-bit words (or, off a multiple of 4 rows, single bytes),
never FP8-typed values (see _fp8_codec's docstring).
"""

from __future__ import annotations

from ._triton import tl, triton

__all__: list[str] = []

if triton is not None:
    from ._fp8_codec import _HARDWARE_FP8, _fp8_code

    @triton.jit
    def _abs_for_amax(v):
        """|v| of fp32 v for a block's amax, NaN ignored. On a GPU tl.max lowers to max.f32,
        which skips a NaN operand (fmaxf); the interpreter's maximum propagates NaN, so there
        NaN becomes 0 first."""
        if _HARDWARE_FP8:
            return tl.abs(v)
        return tl.where(v == v, tl.abs(v), 0.0)

    @triton.jit
    def _block_scale(
        amax, eps, FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr
    ):
        """block_scale_reference on fp32 amax (>= 0 or inf, no NaN), any shape. Power-of-2
        scales by their exponent alone (_pow2_scale_bits), without a division."""
        amax = tl.maximum(amax, eps)  # neither is NaN
        amax_bits = amax.to(tl.int32, bitcast=True)
        if POWER_2:
            scale_bits = _pow2_scale_bits(amax_bits, FP8_MAX, INF_BITS)
        else:
            scale_bits = _quotient_bits(amax_bits, FP8_MAX, INF_BITS)
        scale = scale_bits.to(tl.float32, bitcast=True)
        return tl.where((amax_bits == 0) | (amax_bits >= 0x7F800000), 1.0, scale)

    @triton.jit
    def _quotient_bits(amax_bits, FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr):
        """fp32 bits of fp8_max / amax rounded to nearest (INF_BITS where it overflows), for
        finite amax > 0 given as bits: fp8_max divided by amax's significand 1.f (a quotient in
        (fp8_max / 2, fp8_max]), then amax's exponent e taken from the quotient's, exactly
        (the quotient 2**-e times is normal or overflows; subnormal amax always overflows).
        On a GPU the division is the FMA refinement of an approximate reciprocal that
        div.rn.f32 itself runs for such operands, without its slow path: a call, which would
        keep the tile's values live in twice the registers."""
        sig = ((amax_bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        if _HARDWARE_FP8:
            r = _rcp_approx(sig)
            r = tl.fma(tl.fma(-sig, r, 1.0), r, r)
            q = FP8_MAX * r
            q = tl.fma(tl.fma(-sig, q, FP8_MAX), r, q)
        else:
            q = tl.math.div_rn(FP8_MAX + tl.zeros_like(sig), sig)
        q_bits = q.to(tl.int32, bitcast=True)
        exp = (amax_bits >> 23) - 127
        overflow = (amax_bits < 0x00800000) | ((q_bits >> 23) - exp >= 255)
        return tl.where(overflow, INF_BITS, q_bits - (exp << 23))

    @triton.jit
    def _pow2_scale_bits(amax_bits, FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr):
        """fp32 bits of the exponent of fp8_max / amax rounded to fp32 (of INF_BITS where the
        quotient overflows), for finite amax > 0 given as bits. fp8_max = 1.75 * 2**P, amax =
        1.f * 2**e: the quotient is (1.75 / 1.f) * 2**(P - e), whose first factor is in
        [1, 1.75] for 1.f <= 1.75 (exponent P - e) and in (0.875, 1) above (exponent
        P - e - 1: the quotient of the next fp32 above 1.75 still rounds below 1). Exponents
        of 128 and up overflow, subnormal amax among them (e = -127 here)."""
        P: tl.constexpr = 8 if FP8_MAX == 448.0 else 15
        exp = P + 127 - (amax_bits >> 23) - ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        return tl.where(exp >= 128, INF_BITS & 0x7F800000, (exp + 127) << 23)

    @triton.jit
    def _scale_inv(scale, POWER_2: tl.constexpr):
        """1 / scale rounded to fp32, for a (normal) scale from _block_scale. A power of two
        2**E (E <= 127) by its bits: 2**-E, subnormal for E = 127. Otherwise, on a GPU, the
        reciprocal of the significand refined in fp64 to far below fp32's half ulp (1 / s for
        a 24-bit s is never within 2**-48 of an fp32 rounding boundary), scaled by 2**-E and
        rounded once (subnormal results too): div.rn.f32's slow path is a call (see
        _quotient_bits)."""
        bits = scale.to(tl.int32, bitcast=True)
        if POWER_2:
            inv = tl.where(bits == 0x7F000000, 0x00400000, 0x7F000000 - bits)
            return inv.to(tl.float32, bitcast=True)
        if not _HARDWARE_FP8:
            return tl.math.div_rn(1.0, scale)
        sig = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        r = _rcp_approx(sig).to(tl.float64)
        sig = sig.to(tl.float64)
        r = tl.fma(tl.fma(-sig, r, 1.0), r, r)
        r = tl.fma(tl.fma(-sig, r, 1.0), r, r)
        exp = (1023 + 127 - (bits >> 23)).to(tl.int64) << 52  # 2**-E as fp64 bits
        return (r * exp.to(tl.float64, bitcast=True)).to(tl.float32)

    @triton.jit
    def _rcp_approx(x):
        """The GPU's approximate fp32 reciprocal (within an ulp) of x in [1, 2)."""
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _soft_code(y, FP8_MAX: tl.constexpr):
        """The interpreter's FP8 byte (int32, 0..255) of fp32 y: clamped to +-FP8_MAX,
        _fp8_codec's integer encoder, NaN as 0x7F."""
        y = tl.where(y > FP8_MAX, FP8_MAX, y)
        y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
        return tl.where(y != y, 0x7F, _fp8_code(y, FP8_MAX))

    @triton.jit
    def _codes(v, scale, FP8_MAX: tl.constexpr):
        """FP8 bytes (uint8) of fp32 v * scale, clamped to +-FP8_MAX, rounded to nearest even;
        NaN as 0x7F. On a GPU one conversion instruction per pair, bitcast to bytes at once
        (no FP8-typed value is moved): cvt.rn.satfinite saturates as the clamp does, and the
        product of a NaN is the GPU's canonical NaN 0x7FFFFFFF (positive), whose byte is 0x7F.
        Under the interpreter _fp8_codec's integer encoder."""
        y = v * scale
        if _HARDWARE_FP8:
            if FP8_MAX == 448.0:
                return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            return y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        return _soft_code(y, FP8_MAX).to(tl.uint8)

    @triton.jit
    def _words(v0, v1, v2, v3, scale, FP8_MAX: tl.constexpr):
        """int32 words of the FP8 bytes of four fp32 slices times scale (as _codes), byte k
        from v_k. On a GPU two conversions of two values each and one byte permute per word:
        inline PTX, since Triton pairs neighbouring columns of one slice in its conversions
        and would unpack and repack every byte."""
        y0 = v0 * scale
        y1 = v1 * scale
        y2 = v2 * scale
        y3 = v3 * scale
        if _HARDWARE_FP8:
            if FP8_MAX == 448.0:
                asm: tl.constexpr = (
                    "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }"
                )
            else:
                asm: tl.constexpr = (
                    "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
                    "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }"
                )
            return tl.inline_asm_elementwise(
                asm, "=r,f,f,f,f", [y0, y1, y2, y3], dtype=tl.int32, is_pure=True, pack=1
            )
        c0 = _soft_code(y0, FP8_MAX)
        c1 = _soft_code(y1, FP8_MAX)
        c2 = _soft_code(y2, FP8_MAX)
        c3 = _soft_code(y3, FP8_MAX)
        return c0 | (c1 << 8) | (c2 << 16) | (c3 << 24)

    @triton.jit
    def _load_slice(x_tile, r, c, rows, col_in, ld):
        """fp32 values of tile rows r x columns c at x_tile (row stride ld); 0 in rows >= rows
        and where col_in is False."""
        mask = (r < rows)[:, None] & col_in[None, :]
        return tl.load(x_tile + r[:, None] * ld + c[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _store_bytes(out_tile, code, r, c, rows, col_in, ld):
        """FP8 bytes code (uint8, rows r x columns c) at out_tile (uint8, row stride ld)."""
        mask = (r < rows)[:, None] & col_in[None, :]
        tl.store(out_tile + r[:, None] * ld + c[None, :], code, mask=mask)

    @triton.jit
    def _rows_1x128(
        v, r, c, rows, col_in, out_tile, s_col, K, eps,
        FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr,
    ):  # fmt: skip
        """Slice v (tile rows r, one K-block) cast rowwise: one scale per row, the bytes at
        out_tile (row stride K), the rows' scale_inv at s_col + r."""
        scale = _block_scale(tl.max(_abs_for_amax(v), axis=1), eps, FP8_MAX, INF_BITS, POWER_2)
        _store_bytes(out_tile, _codes(v, scale[:, None], FP8_MAX), r, c, rows, col_in, K)
        tl.store(s_col + r, _scale_inv(scale, POWER_2), mask=r < rows)

    @triton.jit
    def _store_t(
        out_t, words, ld_t, row0, rows, col0, c, col_in, BLOCK: tl.constexpr, WORDS: tl.constexpr
    ):
        """The columnwise bytes of a tile: words (BLOCK // 4, BLOCK) int32, word i of column c
        packing tile rows 4i..4i+3 (byte k: row 4i + k), stored transposed into out_t (uint8,
        row stride ld_t) at [col0 + c, row0 + 4i + k] for tile rows < rows: as int32 words,
        each column's run of words contiguous, where ld_t, row0 and rows are multiples of 4
        (WORDS 1: the caller's promise; 2: checked here), else byte by byte (WORDS 0, or 2
        where they are not). A transpose of 32-bit integers, never of FP8 values (see
        _fp8_codec's docstring)."""
        words_t = tl.trans(words)  # (BLOCK columns, BLOCK // 4 words along the rows)
        j = tl.arange(0, BLOCK // 4)
        aligned = WORDS == 1
        if WORDS == 2:
            aligned = (row0 % 4 == 0) & (rows % 4 == 0)
        if aligned:
            line = (col0 + c).to(tl.int64) * (ld_t // 4) + row0 // 4  # word of [col0 + c, row0]
            ptr = out_t.to(tl.pointer_type(tl.int32)) + line[:, None] + j[None, :]
            tl.store(ptr, words_t, mask=col_in[:, None] & (j < rows // 4)[None, :])
        else:
            line = (col0 + c).to(tl.int64) * ld_t + row0  # byte offset of [col0 + c, row0]
            for k in tl.static_range(4):
                byte = ((words_t >> (8 * k)) & 0xFF).to(tl.uint8)
                mask = col_in[:, None] & (4 * j + k < rows)[None, :]
                tl.store(out_t + line[:, None] + (4 * j + k)[None, :], byte, mask=mask)

    @triton.jit
    def _quantize_1x128_tile(
        x_ptr,  # (T, K) fp32 / bf16 / fp16, contiguous
        out_ptr,  # (T, K) fp8 rowwise data, written as uint8 bytes when ROWWISE
        s_ptr,  # (ceil(K/128), T) fp32 rowwise scale_inv
        out_t_ptr,  # (K, T) fp8 columnwise data, written as int32 words or bytes
        s_t_ptr,  # (S, K) fp32 columnwise scale_inv, row s_t_row written
        T,
        K,
        row0,  # first row of the tile's column blocks
        rows,  # rows in the tile (<= 0: none, the scale row gets zeros; > BLOCK: BLOCK)
        s_t_row,
        col0,  # first column of the tile (a multiple of BLOCK)
        eps,
        FP8_MAX: tl.constexpr,
        INF_BITS: tl.constexpr,
        POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        BLOCK: tl.constexpr,
        WORDS: tl.constexpr,  # how the columnwise bytes are stored (see _store_t)
    ):
        """Rows [row0, row0 + rows) x columns [col0, col0 + BLOCK): the tile read once, as four
        slices of rows 4i + k; each row cast in its 1x128 block, each column in its 128-row
        block, from the same registers. Offsets inside the tile are int32 from a 64-bit tile
        base (the launcher keeps 128 * max(T, K) below 2**31)."""
        r = 4 * tl.arange(0, BLOCK // 4)
        c = tl.arange(0, BLOCK)
        col_in = c < K - col0
        tile = row0.to(tl.int64) * K + col0
        x_tile = x_ptr + tile
        v0 = _load_slice(x_tile, r, c, rows, col_in, K)
        v1 = _load_slice(x_tile, r + 1, c, rows, col_in, K)
        v2 = _load_slice(x_tile, r + 2, c, rows, col_in, K)
        v3 = _load_slice(x_tile, r + 3, c, rows, col_in, K)
        _cast_1x128_slices(
            v0, v1, v2, v3, r, c, rows, col_in, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, row0,
            s_t_row, col0, eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK, WORDS,
        )  # fmt: skip

    @triton.jit
    def _cast_1x128_slices(
        v0, v1, v2, v3, r, c, rows, col_in, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, row0,
        s_t_row, col0, eps, FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr,
        POWER_2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
        BLOCK: tl.constexpr, WORDS: tl.constexpr,
    ):  # fmt: skip
        """A tile's four slices (rows 4i + k, fp32, of rows [row0, row0 + rows) x columns
        [col0, col0 + BLOCK) of a (T, K) value) cast in 1x128 blocks from the same registers:
        each row in its K-block (rowwise), each column in its 128-row block (columnwise, scale
        row s_t_row; zeros where the tile has no rows). The producers that write 1x128 FP8
        themselves (activation_block.py) call it on the values they computed."""
        tile = row0.to(tl.int64) * K + col0
        if ROWWISE:
            out = out_ptr.to(tl.pointer_type(tl.uint8)) + tile
            s_col = s_ptr + (col0 // BLOCK).to(tl.int64) * T + row0
            _rows_1x128(v0, r, c, rows, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2)
            _rows_1x128(v1, r + 1, c, rows, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2)
            _rows_1x128(v2, r + 2, c, rows, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2)
            _rows_1x128(v3, r + 3, c, rows, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2)
        if COLUMNWISE:
            amax = tl.maximum(
                tl.maximum(_abs_for_amax(v0), _abs_for_amax(v1)),
                tl.maximum(_abs_for_amax(v2), _abs_for_amax(v3)),
            )
            scale_t = _block_scale(tl.max(amax, axis=0), eps, FP8_MAX, INF_BITS, POWER_2)[None, :]
            words = _words(v0, v1, v2, v3, scale_t, FP8_MAX)
            out_t = out_t_ptr.to(tl.pointer_type(tl.uint8))
            _store_t(out_t, words, T, row0, rows, col0, c, col_in, BLOCK, WORDS)
            inv_t = tl.where(rows > 0, _scale_inv(scale_t, POWER_2), 0.0)
            tl.store(s_t_ptr + s_t_row.to(tl.int64) * K + col0 + c[None, :], inv_t, col_in[None, :])

    @triton.jit
    def _tile_of(t, n_m, n_k, GROUP_M: tl.constexpr):
        """(pid_m, pid_k) of the t-th tile of an n_m x n_k grid of tiles in launch order: bands
        of GROUP_M rows of tiles one after another, down the band's rows first (GROUP_M 1: a
        row of tiles at a time, the input read in order; GROUP_M >= n_m: a column at a time,
        the columnwise copy written in order)."""
        per_band = GROUP_M * n_k
        first_m = (t // per_band) * GROUP_M
        in_band = t % per_band
        band = tl.minimum(n_m - first_m, GROUP_M)
        return first_m + in_band % band, in_band // band

    @triton.jit
    def _group_rows(row_offsets_ptr, G, pid_b, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr):
        """(row0, rows) of scale row pid_b of the grouped layout: group g's block pid_b - b_g,
        found from the offsets on the device; past the last group's blocks, no rows."""
        groups = tl.arange(0, BLOCK_G)
        g_in = groups < G
        starts = tl.load(row_offsets_ptr + groups, mask=g_in, other=0)
        ends = tl.load(row_offsets_ptr + groups + 1, mask=g_in, other=0)
        blocks = (ends - starts + BLOCK - 1) // BLOCK
        block_ends = tl.cumsum(blocks, 0)
        g = tl.sum(((block_ends <= pid_b) & g_in).to(tl.int32))
        mine = groups == g  # all False past the last group: rows [b * 128, 0), none
        first_block = tl.sum(tl.where(mine, block_ends - blocks, 0))
        row0 = tl.sum(tl.where(mine, starts, 0)) + (pid_b - first_block) * BLOCK
        return row0, tl.minimum(row0 + BLOCK, tl.sum(tl.where(mine, ends, 0))) - row0

    @triton.jit
    def _grouped_tile(
        x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b, pid_k, eps,
        FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr,
        WORDS: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        """Tile (scale row pid_b, K-block pid_k) of the grouped cast."""
        row0, rows = _group_rows(row_offsets_ptr, G, pid_b, BLOCK, BLOCK_G)
        _quantize_1x128_tile(
            x_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, row0, rows, pid_b, pid_k * BLOCK,
            eps, FP8_MAX, INF_BITS, POWER_2, ROWWISE, COLUMNWISE, BLOCK, 2 if WORDS else 0,
        )  # fmt: skip

    @triton.jit
    def _quantize_2d_tile(
        x_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, R, C, b, pid_r, pid_c, eps,
        FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr,
        WORDS: tl.constexpr,
    ):  # fmt: skip
        """Tile (pid_r, pid_c) of matrix b read once (four slices of rows 4i + k): its amax,
        one scale, the bytes cast once and written for each usage (the columnwise copy as the
        transposed words); the scale_inv twice, the last tile of a row of tiles zeroing that
        scale row's padding."""
        row0 = pid_r * BLOCK
        col0 = pid_c * BLOCK
        rows = R - row0
        r = 4 * tl.arange(0, BLOCK // 4)
        c = tl.arange(0, BLOCK)
        col_in = c < C - col0
        mat = b.to(tl.int64) * R * C
        tile = mat + row0.to(tl.int64) * C + col0
        x_tile = x_ptr + tile
        v0 = _load_slice(x_tile, r, c, rows, col_in, C)
        v1 = _load_slice(x_tile, r + 1, c, rows, col_in, C)
        v2 = _load_slice(x_tile, r + 2, c, rows, col_in, C)
        v3 = _load_slice(x_tile, r + 3, c, rows, col_in, C)
        amax = tl.maximum(
            tl.maximum(_abs_for_amax(v0), _abs_for_amax(v1)),
            tl.maximum(_abs_for_amax(v2), _abs_for_amax(v3)),
        )
        scale = _block_scale(tl.max(tl.max(amax, axis=1), axis=0), eps, FP8_MAX, INF_BITS, POWER_2)
        if ROWWISE:
            out = out_ptr.to(tl.pointer_type(tl.uint8)) + tile
            _store_bytes(out, _codes(v0, scale, FP8_MAX), r, c, rows, col_in, C)
            _store_bytes(out, _codes(v1, scale, FP8_MAX), r + 1, c, rows, col_in, C)
            _store_bytes(out, _codes(v2, scale, FP8_MAX), r + 2, c, rows, col_in, C)
            _store_bytes(out, _codes(v3, scale, FP8_MAX), r + 3, c, rows, col_in, C)
        if COLUMNWISE:
            words = _words(v0, v1, v2, v3, scale, FP8_MAX)
            out_t = out_t_ptr.to(tl.pointer_type(tl.uint8)) + mat
            _store_t(out_t, words, R, row0, rows, col0, c, col_in, BLOCK, WORDS)
        inv = _scale_inv(scale, POWER_2)
        n_r = tl.cdiv(R, BLOCK)
        n_c = tl.cdiv(C, BLOCK)
        pad = tl.arange(0, 4)
        if ROWWISE:
            width = (n_c + 3) // 4 * 4
            s_row = s_ptr + (b * n_r + pid_r) * width
            tl.store(s_row + pid_c, inv)
            pad_in = (n_c + pad < width) & (pid_c == n_c - 1)
            tl.store(s_row + n_c + pad, tl.zeros((4,), tl.float32), mask=pad_in)
        if COLUMNWISE:
            width_t = (n_r + 3) // 4 * 4
            s_t_row = s_t_ptr + (b * n_c + pid_c) * width_t
            tl.store(s_t_row + pid_r, inv)
            pad_in_t = (n_r + pad < width_t) & (pid_r == n_r - 1)
            tl.store(s_t_row + n_r + pad, tl.zeros((4,), tl.float32), mask=pad_in_t)

    # ------------------------------------------------------------------------------------------
    # The grouped cast's tile on a 16-row-aligned window (T % 16 == 0): every columnwise byte
    # of a 16-byte chunk wholly inside the tile's block goes out in 16-byte stores, whatever
    # the group sizes; only the chunks the block's first and last rows share with a neighbour
    # go out byte by byte.
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _load_rows_in(x_tile, r, c, lo, hi, col_in, ld):
        """fp32 values of tile rows r x columns c at x_tile (row stride ld); 0 in rows outside
        [lo, hi) and where col_in is False."""
        mask = ((r >= lo) & (r < hi))[:, None] & col_in[None, :]
        return tl.load(x_tile + r[:, None] * ld + c[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _rows_1x128_in(
        v, r, c, lo, hi, col_in, out_tile, s_col, K, eps,
        FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr,
    ):  # fmt: skip
        """Slice v (tile rows r, one K-block) cast rowwise as _rows_1x128, rows in [lo, hi)
        stored."""
        scale = _block_scale(tl.max(_abs_for_amax(v), axis=1), eps, FP8_MAX, INF_BITS, POWER_2)
        r_in = (r >= lo) & (r < hi)
        ptr = out_tile + r[:, None] * K + c[None, :]
        tl.store(ptr, _codes(v, scale[:, None], FP8_MAX), mask=r_in[:, None] & col_in[None, :])
        tl.store(s_col + r, _scale_inv(scale, POWER_2), mask=r_in)

    @triton.jit
    def _store_t_chunks(out_t, words, T, base, lo, hi, col0, c, col_in, BLOCK: tl.constexpr):
        """The columnwise words (BLOCK // 4, BLOCK) of window rows [0, BLOCK) (word i: rows
        4i..4i+3), transposed into out_t (uint8, (K, T), T % 16 == 0) at [col0 + c, base + 4i]
        (base % 16 == 0), for the 16-row chunks wholly inside the block's rows [lo, hi): 16-byte
        aligned runs, stored four words at a time."""
        words_t = tl.trans(words)  # (BLOCK columns, BLOCK // 4 words along the rows)
        j = tl.arange(0, BLOCK // 4)
        first = (lo + 15) // 16 * 4  # multiples of 4 words: the mask is constant per chunk
        last = hi // 16 * 4
        line = (col0 + c).to(tl.int64) * (T // 4) + base // 4
        ptr = out_t.to(tl.pointer_type(tl.int32)) + line[:, None] + j[None, :]
        tl.store(ptr, words_t, mask=col_in[:, None] & ((j >= first) & (j < last))[None, :])

    @triton.jit
    def _store_t_bytes_in(out_t, words, T, base, lo, hi, col0, c, col_in, BLOCK: tl.constexpr):
        """The columnwise words (BLOCK // 4, BLOCK) of window rows [0, BLOCK) (word i: rows
        4i..4i+3) transposed into out_t (uint8, (K, T), any T) at [col0 + c, base + row], byte
        by byte, for the rows in [lo, hi)."""
        words_t = tl.trans(words)
        j = tl.arange(0, BLOCK // 4)
        line = (col0 + c).to(tl.int64) * T + base
        for k in tl.static_range(4):
            byte = ((words_t >> (8 * k)) & 0xFF).to(tl.uint8)
            row = 4 * j + k
            mask = col_in[:, None] & ((row >= lo) & (row < hi))[None, :]
            tl.store(out_t + line[:, None] + row[None, :], byte, mask=mask)

    @triton.jit
    def _edge_rows(lo, hi, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        """(rows (32,), which to write) of the window rows whose columnwise bytes go out byte
        by byte beside _store_t_chunks' (ALIGNED) or _store_t_bytes_in's (not) stores: the
        block's rows [lo, hi) of the 16-row chunks it shares with a neighbouring block (the
        first where lo > 0, the one holding row hi - 1 where hi % 16 != 0) when ALIGNED, else
        those past the window (rows >= BLOCK). Interleaved (first chunk's row 0, last's row 0,
        first's row 1, ...): no two rows are neighbours in memory, so Triton's store layout
        puts a warp along the rows of one column (2 sectors a store), not 16 bytes per thread
        with a warp across 16 columns (32 sectors)."""
        i = tl.arange(0, 32)
        tail = (hi - 1) // 16 * 16
        rows = tl.where(i % 2 == 0, i // 2, tail + i // 2)
        if ALIGNED:
            chunk = tl.where(i % 2 == 0, lo > 0, hi % 16 != 0)
        else:
            chunk = (i % 2 == 1) & (rows >= BLOCK)
        return rows, chunk & (rows >= lo) & (rows < hi)

    @triton.jit
    def _store_edge_bytes(
        out_t, v, scale_t, T, base, rows, want, col0, c, col_in, FP8_MAX: tl.constexpr
    ):
        """The columnwise bytes of v (32, BLOCK) fp32, window rows `rows` (_edge_rows) times
        scale_t (1, BLOCK), at [col0 + c, base + rows] of out_t (uint8, (K, T)) where want."""
        ptr = out_t + (col0 + c).to(tl.int64)[None, :] * T + base + rows[:, None]
        tl.store(ptr, _codes(v, scale_t, FP8_MAX), mask=want[:, None] & col_in[None, :])

    @triton.jit
    def _grouped_tile_16(
        x_ptr, row_offsets_ptr, out_ptr, s_ptr, out_t_ptr, s_t_ptr, T, K, G, pid_b, pid_k, eps,
        FP8_MAX: tl.constexpr, INF_BITS: tl.constexpr, POWER_2: tl.constexpr,
        ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        """Tile (scale row pid_b, K-block pid_k) of the grouped cast for T % 16 == 0: the
        block's rows [row0, row0 + rows) read as a window of BLOCK rows from base = row0 rounded
        down to 16 (four slices of rows 4i + k) and the 16 rows after it, rows outside the block
        masked; so the columnwise words sit at 16-byte aligned addresses (_store_t_chunks) and
        only the edge chunks go byte by byte (_edge_rows). Bytes as _grouped_tile's."""
        row0, rows = _group_rows(row_offsets_ptr, G, pid_b, BLOCK, BLOCK_G)
        col0 = pid_k * BLOCK
        base = row0 // 16 * 16
        lo = row0 - base  # the block's rows in the window: [lo, hi), hi <= lo + BLOCK < BLOCK + 16
        hi = lo + rows
        r = 4 * tl.arange(0, BLOCK // 4)
        e = BLOCK + tl.arange(0, 16)  # the rows after the window
        c = tl.arange(0, BLOCK)
        col_in = c < K - col0
        tile = base.to(tl.int64) * K + col0
        x_tile = x_ptr + tile
        v0 = _load_rows_in(x_tile, r, c, lo, hi, col_in, K)
        v1 = _load_rows_in(x_tile, r + 1, c, lo, hi, col_in, K)
        v2 = _load_rows_in(x_tile, r + 2, c, lo, hi, col_in, K)
        v3 = _load_rows_in(x_tile, r + 3, c, lo, hi, col_in, K)
        ve = _load_rows_in(x_tile, e, c, lo, hi, col_in, K)
        if ROWWISE:
            out = out_ptr.to(tl.pointer_type(tl.uint8)) + tile
            s_col = s_ptr + (col0 // BLOCK).to(tl.int64) * T + base
            _rows_1x128_in(v0, r, c, lo, hi, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2)
            _rows_1x128_in(
                v1, r + 1, c, lo, hi, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2
            )
            _rows_1x128_in(
                v2, r + 2, c, lo, hi, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2
            )
            _rows_1x128_in(
                v3, r + 3, c, lo, hi, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2
            )
            _rows_1x128_in(ve, e, c, lo, hi, col_in, out, s_col, K, eps, FP8_MAX, INF_BITS, POWER_2)
        if COLUMNWISE:
            amax = tl.maximum(
                tl.maximum(_abs_for_amax(v0), _abs_for_amax(v1)),
                tl.maximum(_abs_for_amax(v2), _abs_for_amax(v3)),
            )
            amax = tl.maximum(tl.max(amax, axis=0), tl.max(_abs_for_amax(ve), axis=0))
            scale_t = _block_scale(amax, eps, FP8_MAX, INF_BITS, POWER_2)[None, :]
            words = _words(v0, v1, v2, v3, scale_t, FP8_MAX)
            out_t = out_t_ptr.to(tl.pointer_type(tl.uint8))
            _store_t_chunks(out_t, words, T, base, lo, hi, col0, c, col_in, BLOCK)
            pr, want = _edge_rows(lo, hi, BLOCK, True)  # read again: in cache
            edge_in = want[:, None] & col_in[None, :]
            v = tl.load(x_tile + pr[:, None] * K + c[None, :], mask=edge_in, other=0.0)
            _store_edge_bytes(
                out_t, v.to(tl.float32), scale_t, T, base, pr, want, col0, c, col_in, FP8_MAX
            )
            inv_t = tl.where(rows > 0, _scale_inv(scale_t, POWER_2), 0.0)
            tl.store(s_t_ptr + pid_b.to(tl.int64) * K + col0 + c[None, :], inv_t, col_in[None, :])
