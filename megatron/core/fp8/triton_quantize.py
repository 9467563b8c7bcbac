"""FP8 quantization in as few launches as the GPU allows: Triton kernels, where Triton and a CUDA device are present.

- `amax(x)`: one pass; every program reduces its stretch of `x` to one max(|x|) and folds it into a one-element
  fp32 buffer with an atomic max (NaN counts as +inf, so a bad tensor still gives the "bad amax" scale 1).
- `quantize(x, dtype, scale_amax, ...)`: one pass over a 2-D tile grid that computes the scale from
  `scale_amax` (`target / amax`, 1 where that is not a positive finite number), writes the float8 bytes, the
  transposed bytes when asked for (from the same tile, so no second pass), the scale and its reciprocal, and
  with `record_amax` this tensor's own amax (delayed scaling: the scale comes from the history, the new amax is
  recorded from the same pass).

The float8 bytes are those of `clamp(x * scale, -limit, limit).to(dtype)` in fp32 with round-to-nearest-even,
the eager path's. The kernel rounds onto the float8 grid itself (adding and subtracting a power of two that
puts the grid spacing at fp32's last place, which rounds to nearest even) and then converts the exact value, so
the result does not depend on the conversion instruction's rounding mode: the same bytes on the GPU and under
Triton's CPU interpreter (`TRITON_INTERPRET=1`), which tests use.

The kernels are built on first use (`kernels()`), so a process that sets `TRITON_INTERPRET` before that gets
the interpreted ones.
"""

import functools

import torch

from megatron.core.fp8.formats import fp8_max

AMAX_BLOCK = 4096
AMAX_PROGRAMS_PER_SM = 4
TILE_ROWS = 64
TILE_COLS = 128

# float8 format -> (mantissa bits, smallest normal exponent)
_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def have_triton() -> bool:
    try:
        from triton import jit, language
    except Exception:  # not installed, or no working build for this platform
        return False
    return jit is not None and language is not None


def supports(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernels take this tensor (a CUDA tensor of a float dtype, at most 2-D once flattened) and
    float8 dtype, with Triton importable."""
    return (tensor.is_cuda and tensor.dtype in _SOURCE_DTYPES and dtype in _GRID and tensor.dim() in (1, 2)
            and 0 < tensor.numel() < 2**31 and have_triton())


@functools.cache
def kernels():
    """(amax kernel, quantize kernel), JIT-compiled on first launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def amax_kernel(x_ptr, amax_ptr, numel, BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        running = tl.zeros([BLOCK], dtype=tl.float32)
        for step in range(0, BLOCKS_PER_PROGRAM):
            offsets = (program * BLOCKS_PER_PROGRAM + step) * BLOCK + tl.arange(0, BLOCK)
            values = tl.abs(tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32))
            values = tl.where(values == values, values, float("inf"))  # NaN -> inf
            running = tl.maximum(running, values)
        tl.atomic_max(amax_ptr, tl.max(running, axis=0))

    @triton.jit
    def quantize_kernel(x_ptr, out_ptr, out_t_ptr, scale_amax_ptr, amax_out_ptr, scale_ptr, scale_inv_ptr,
                        rows, cols, target, limit,
                        MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, WRITE_TRANSPOSE: tl.constexpr,
                        RECORD_AMAX: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        # target / amax as the eager path computes it (`target * (1 / amax)`, two roundings).
        scale = tl.math.div_rn(1.0, tl.load(scale_amax_ptr)) * target
        scale = tl.where((scale > 0) & (scale < float("inf")), scale, 1.0)
        row_block = tl.program_id(0)
        col_block = tl.program_id(1)
        if (row_block == 0) & (col_block == 0):
            tl.store(scale_ptr, scale)
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
        row_ids = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        col_ids = (col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)).to(tl.int64)
        mask = (row_ids[:, None] < rows) & (col_ids[None, :] < cols)
        x = tl.load(x_ptr + row_ids[:, None] * cols + col_ids[None, :], mask=mask, other=0.0).to(tl.float32)
        if RECORD_AMAX:
            magnitude = tl.abs(x)
            magnitude = tl.where(magnitude == magnitude, magnitude, float("inf"))
            tl.atomic_max(amax_out_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))
        scaled = x * scale
        y = tl.minimum(tl.maximum(scaled, -limit), limit)
        # Round |y| to nearest even onto the float8 grid: the grid spacing of its binade (the subnormal spacing
        # below the smallest normal), made fp32's last place by adding 1.5 * 2**23 spacings; the sign goes back
        # on afterwards (so -0.0 stays -0.0), and NaN stays NaN.
        bits = y.to(tl.int32, bitcast=True)
        sign = bits & -2147483648
        magnitude_bits = bits & 2147483647
        exponent = tl.maximum((magnitude_bits >> 23) - 127, MIN_EXPONENT)
        spacing = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
        shift = spacing * 12582912.0  # 1.5 * 2**23
        rounded = (magnitude_bits.to(tl.float32, bitcast=True) + shift) - shift
        rounded = (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        rounded = tl.where(scaled == scaled, rounded, scaled)
        data = rounded.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row_ids[:, None] * cols + col_ids[None, :], data, mask=mask)
        if WRITE_TRANSPOSE:
            # Transposed in fp32 and converted after (the same exact values), so no float8 layout conversion.
            data_t = tl.trans(rounded).to(out_t_ptr.dtype.element_ty)
            tl.store(out_t_ptr + col_ids[:, None] * rows + row_ids[None, :], data_t, mask=tl.trans(mask))

    return amax_kernel, quantize_kernel


@functools.cache
def _multiprocessors(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _blocks_per_program(tensor):
    """Blocks each amax program reduces: a power of two (so few kernel variants are compiled) that leaves about
    `AMAX_PROGRAMS_PER_SM` programs per multiprocessor, each folding its result in with one atomic."""
    blocks = -(-tensor.numel() // AMAX_BLOCK)
    sms = _multiprocessors(tensor.device.index) if tensor.is_cuda else 8
    wanted = max(1, blocks // (sms * AMAX_PROGRAMS_PER_SM))
    return 1 << (wanted.bit_length() - 1)


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max(|tensor|) as a one-element fp32 tensor (NaN counted as +inf), from one pass."""
    flat = tensor.contiguous()  # read as a flat array: the kernel takes the pointer and the element count
    out = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    amax_kernel, _ = kernels()
    numel = flat.numel()
    blocks_per_program = _blocks_per_program(flat)
    programs = -(-numel // (AMAX_BLOCK * blocks_per_program))
    amax_kernel[(programs,)](flat, out, numel, BLOCKS_PER_PROGRAM=blocks_per_program, BLOCK=AMAX_BLOCK)
    return out


def quantize(tensor: torch.Tensor, dtype: torch.dtype, scale_amax: torch.Tensor, margin: int = 0,
             with_transpose: bool = False, record_amax: bool = False):
    """(data, transposed data or None, scale, scale_inv, this tensor's amax or None) of `tensor` (1-D or 2-D)
    quantized to `dtype` with the scale of `scale_amax` (a one-element fp32 tensor), from one pass."""
    matrix = tensor.contiguous()
    if matrix.dim() == 1:
        matrix = matrix.view(1, -1)
    rows, cols = matrix.shape
    device = tensor.device
    limit = fp8_max(dtype)
    mantissa_bits, min_exponent = _GRID[dtype]
    data = torch.empty((rows, cols), dtype=dtype, device=device)
    transpose = torch.empty((cols, rows), dtype=dtype, device=device) if with_transpose else None
    # The scale and its reciprocal in allocations of their own: cuBLASLt refuses a scale pointer into the middle
    # of another tensor (torch._scaled_mm then fails with CUBLAS_STATUS_NOT_SUPPORTED).
    scale = torch.empty((), dtype=torch.float32, device=device)
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    own_amax = torch.zeros(1, dtype=torch.float32, device=device) if record_amax else None
    _, quantize_kernel = kernels()
    grid = (-(-rows // TILE_ROWS), -(-cols // TILE_COLS))
    # The kernel reads the one element of `scale_amax` through its pointer, whatever its shape.
    if scale_amax.dtype != torch.float32:
        scale_amax = scale_amax.to(torch.float32)
    quantize_kernel[grid](
        matrix, data, transpose if with_transpose else data, scale_amax,
        own_amax if record_amax else scale, scale, scale_inv, rows, cols, limit / (2.0**margin), limit,
        MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent, WRITE_TRANSPOSE=with_transpose,
        RECORD_AMAX=record_amax, BLOCK_ROWS=TILE_ROWS, BLOCK_COLS=TILE_COLS,
    )
    if tensor.dim() == 1:
        data = data.view(-1)
    return data, transpose, scale, scale_inv, None if own_amax is None else own_amax[0]
