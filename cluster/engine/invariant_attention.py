"""Decode attention whose arithmetic depends on a row's own keys alone (the batch-invariant mode, invariant.py).

MLX's attention over a batched, left-padded cache splits each row's keys by their place in the
buffer, so a row's padding and the buffer's length (the longest row's) change the order of its
sums. Here every choice is a function of the key's logical index (0 = the row's oldest key):

    logical keys  [0 .. 255][256 .. 511][512 ..    ]      chunks of CHUNK keys, one block each
                   |  key j to warp j % WARPS, in order; lanes split the head dimension,
                   |  their partial dot products meet in a fixed xor butterfly
                   v
    per chunk: the warps' online softmaxes merged in warp order     (pass 1)
    per row:   the chunks merged in chunk order, empty ones skipped (pass 2)

A row's chunks are the same whatever the batch; the chunks past its keys are empty and skipped, so
its result is bitwise the same in a buffer of any length, beside any rows. A buffer of one chunk
takes pass 1 alone and divides there: that is the same arithmetic as pass 2 over one chunk (x * 1,
0 + x and a sum started at +0 are exact). A block serves one KV head's G query heads, so each key is
read once per row.

Where the row's keys are in the buffer: its last `count[b]` keys end at physical index `end` - 1
and wrap around the key axis (a rotating cache's ring); `rows_of` reads that off mlx-lm's batched
caches. `reference_attention` computes the same in MLX ops, one row at a time: where the kernel
cannot run (the CPU), it lets tests drive the mode's whole path.
"""

from __future__ import annotations

import mlx.core as mx

WARPS = 8  # warps per block; with CHUNK, the kernel's order of sums: constants, never tuned per shape
CHUNK = 256  # logical keys per block

_PASS1 = r"""
    constexpr int E = (D + 31) / 32;
    const int b = blockIdx.y / HK, hk = blockIdx.y % HK, c = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = count[b], R = keys_shape[2];
    const int lo = c * CHUNK, hi = min(n, lo + CHUNK);
    int start = (end[0] - n) % R;
    if (start < 0) start += R;
    __shared__ float s_m[NW * G], s_l[NW * G], s_o[G * D];
    float q[G][E], acc[G][E], m[G], l[G];
    for (int g = 0; g < G; ++g) {
        const T* qp = queries + b * queries_strides[0] + (hk * G + g) * queries_strides[1];
        for (int i = 0; i < E; ++i) {
            const int e = lane + 32 * i;
            q[g][i] = e < D ? static_cast<float>(qp[e * queries_strides[3]]) * scale[0] : 0.f;
            acc[g][i] = 0.f;
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (int j = lo + warp; j < hi; j += NW) {
        int p = start + j;
        if (p >= R) p -= R;
        const T* kp = keys + b * keys_strides[0] + hk * keys_strides[1] + (size_t)p * keys_strides[2];
        const T* vp = values + b * values_strides[0] + hk * values_strides[1] + (size_t)p * values_strides[2];
        float kv[E], vv[E];
        for (int i = 0; i < E; ++i) {
            const int e = lane + 32 * i;
            kv[i] = e < D ? static_cast<float>(kp[e * keys_strides[3]]) : 0.f;
            vv[i] = e < D ? static_cast<float>(vp[e * values_strides[3]]) : 0.f;
        }
        for (int g = 0; g < G; ++g) {
            float d = 0.f;
            for (int i = 0; i < E; ++i) d += q[g][i] * kv[i];
            for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            const float mn = fmaxf(m[g], d), f = expf(m[g] - mn), w = expf(d - mn);
            l[g] = l[g] * f + w;
            for (int i = 0; i < E; ++i) acc[g][i] = acc[g][i] * f + w * vv[i];
            m[g] = mn;
        }
    }
    if (lane == 0) {
        for (int g = 0; g < G; ++g) { s_m[warp * G + g] = m[g]; s_l[warp * G + g] = l[g]; }
    }
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) s_o[t] = 0.f;
    __syncthreads();
    // The warps' outputs, each scaled to the chunk's maximum, summed in warp order: one warp at a time adds
    // its own into s_o (G * D floats, not NW copies of them: 8 query heads of 256 per KV head needed 66 KB).
    for (int w = 0; w < NW; ++w) {
        if (warp == w) {
            for (int g = 0; g < G; ++g) {
                if (!(l[g] > 0.f)) continue;  // no keys in this warp: skipped, as an empty chunk is in pass 2
                float M = -INFINITY;
                for (int v = 0; v < NW; ++v) M = fmaxf(M, s_m[v * G + g]);
                const float f = expf(m[g] - M);
                for (int i = 0; i < E; ++i) {
                    const int e = lane + 32 * i;
                    if (e < D) s_o[g * D + e] += acc[g][i] * f;
                }
            }
        }
        __syncthreads();
    }
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int g = t / D, e = t % D;
        float M = -INFINITY;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w * G + g]);
        float L = 0.f;
        for (int w = 0; w < NW; ++w) {
            if (s_l[w * G + g] > 0.f) L += s_l[w * G + g] * expf(s_m[w * G + g] - M);
        }
        const float o = s_o[t];
        const size_t row = (size_t)b * HK * G + hk * G + g;
        WRITE
    }
"""
_WRITE = {  # one chunk: the result; more: the chunk's part, for pass 2
    "single": "out[row * D + e] = static_cast<T>(L > 0.f ? o / L : 0.f);",
    "pass1": """const size_t at = row * gridDim.z + c;
        if (e == 0) { part_m[at] = M; part_l[at] = L; }
        part_acc[at * D + e] = o;""",
}

_PASS2 = r"""
    // One thread per (row, query head, element): the row's chunks in order, empty ones skipped.
    const int e = threadIdx.x, rh = blockIdx.y, C = part_m_shape[2];
    const float* pm = part_m + (size_t)rh * C;
    const float* pl = part_l + (size_t)rh * C;
    float M = -INFINITY;
    for (int c = 0; c < C; ++c) if (pl[c] > 0.f) M = fmaxf(M, pm[c]);
    float L = 0.f, o = 0.f;
    for (int c = 0; c < C; ++c) {
        if (pl[c] > 0.f) {
            const float f = expf(pm[c] - M);
            L += pl[c] * f;
            o += part_acc[((size_t)rh * C + c) * D + e] * f;
        }
    }
    out[(size_t)rh * D + e] = static_cast<T>(L > 0.f ? o / L : 0.f);
"""

_INPUTS = ["queries", "keys", "values", "count", "end", "scale"]
_kernels: dict[str, object] = {}
_scales: dict[float, mx.array] = {}


def _kernel(name: str):
    if name not in _kernels:
        if name == "pass2":
            _kernels[name] = mx.fast.cuda_kernel("mlx_fleet_invariant_merge", ["part_m", "part_l", "part_acc"],
                                                 ["out"], _PASS2)
        else:
            _kernels[name] = mx.fast.cuda_kernel(
                f"mlx_fleet_invariant_{name}", _INPUTS, ["out"] if name == "single" else ["part_m", "part_l", "part_acc"],
                _PASS1.replace("WRITE", _WRITE[name]), ensure_row_contiguous=False)
    return _kernels[name]


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, count: mx.array,
              end: int) -> mx.array:
    """Softmax attention of one query per row over each row's last `count[b]` keys, which end at
    physical index `end` - 1 of the key axis, wrapping around it."""
    if not mx.cuda.is_available():
        return reference_attention(queries, keys, values, scale, count, end)
    if not supports(queries, keys, values):
        raise RuntimeError(f"invariant attention: unsupported shapes {queries.shape} {keys.shape} {values.shape}")
    B, hq, _, D = queries.shape
    hk, R = keys.shape[1], keys.shape[2]
    s = _scales.get(scale)
    if s is None:
        s = _scales[scale] = mx.array([scale], mx.float32)
    chunks = max(1, -(-R // CHUNK))
    inputs = [queries, keys, values, count.astype(mx.int32), mx.array([end], mx.int32), s]
    template = [("T", queries.dtype), ("D", D), ("HK", hk), ("G", hq // hk), ("NW", WARPS), ("CHUNK", CHUNK)]
    grid, block = (32 * WARPS, B * hk, chunks), (32 * WARPS, 1, 1)
    if chunks == 1:
        return _kernel("single")(inputs=inputs, template=template, grid=grid, threadgroup=block,
                                 output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]
    parts = _kernel("pass1")(inputs=inputs, template=template, grid=grid, threadgroup=block,
                             output_shapes=[(B, hq, chunks), (B, hq, chunks), (B, hq, chunks, D)],
                             output_dtypes=[mx.float32] * 3)
    return _kernel("pass2")(inputs=parts, template=[("T", queries.dtype), ("D", D)], grid=(D, B * hq, 1),
                            threadgroup=(D, 1, 1), output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def reference_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, count: mx.array,
                        end: int) -> mx.array:
    """What `attention` computes, in MLX ops, one row at a time: each row's keys gathered in temporal
    order and attended alone. Batch-invariant by construction, but slow (it reads `count` back)."""
    R, out = keys.shape[2], []
    for b, n in enumerate(count.tolist()):
        if n == 0:
            out.append(mx.zeros_like(queries[b:b + 1]))
            continue
        idx = (mx.arange(n) + (end - n) % R) % R
        k, v = keys[b:b + 1, :, idx], values[b:b + 1, :, idx]
        out.append(mx.fast.scaled_dot_product_attention(queries[b:b + 1], k, v, scale=scale))
    return mx.concatenate(out)


SHARED_BYTES = 48 << 10  # a block's static shared memory on every CUDA GPU
# The widest head of a family served here: Gemma 4's global layers. Wider would also fit pass 2's block (a thread
# per element, up to 1,024), but each lane keeps 2 * G * D / 32 floats: at 512 and G = 8 ptxas already spills a
# little (NVRTC for sm_90: 255 registers, 532 bytes), so a wider head is left to MLX's attention.
MAX_HEAD_DIM = 512


def supports(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether `attention` takes these (plain arrays, not a quantized cache's tuples; one query per row, a head
    dim up to MAX_HEAD_DIM, grouped heads whose outputs fit a block's shared memory: s_m, s_l and s_o)."""
    if not (all(isinstance(a, mx.array) for a in (queries, keys, values)) and queries.shape[2] == 1
            and values.shape[-1] == queries.shape[-1] <= MAX_HEAD_DIM and queries.shape[1] % keys.shape[1] == 0):
        return False
    g, d = queries.shape[1] // keys.shape[1], queries.shape[-1]
    return (2 * WARPS * g + g * d) * 4 <= SHARED_BYTES


def batched(cache) -> bool:
    """A batch's cache (left-padded rows, each masked by its count), not one sequence's."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    return isinstance(cache, (BatchKVCache, BatchRotatingKVCache))


def rows_of(cache, keys: mx.array):
    """(count, end) of a cache just updated, batched or one sequence's: each row's number of keys, and where
    the newest ends. None for a cache this does not know (its attention then stays mlx-lm's)."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    if isinstance(cache, BatchKVCache):
        return cache.offset, cache._idx
    if isinstance(cache, BatchRotatingKVCache):
        return mx.minimum(cache.offset, keys.shape[2]), cache._idx
    R = keys.shape[2]
    if type(cache) is KVCache:  # keys[..., :offset]: in order, the newest last
        return mx.full((keys.shape[0],), R, mx.int32), R
    if type(cache) is RotatingKVCache and cache.keep == 0:
        # A slice of the buffer ([:offset], before the ring first wraps) is in order; the whole ring holds
        # the newest key at _idx - 1
        return mx.full((keys.shape[0],), R, mx.int32), (R if R < cache.keys.shape[2] else cache._idx)
    return None
