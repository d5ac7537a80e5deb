// kvtier-worker's GPU kernels (feature `cuda`): the Llama forward in f32, reading and writing
// the paged KV pool in place.
//
// The pool holds whole kvtier blocks, `[layer][K|V][token][kv_head][head_dim]` f32, block `b`
// at float offset `b * block_floats`; a sequence's block table maps position `p` to block
// `table[p / block_tokens]`, slot `p % block_tokens`. Activations are row-major
// `[token][features]`; projection weights are Hugging Face's `[out][in]`.
//
// Compiled to PTX by NVRTC (`kernels.ptx` beside this file, checked in and checked by
// `cargo test -p kvtier-worker --features cuda`), so a machine needs only the CUDA driver.
// Every kernel is written for clarity first; they are not tuned.

#define MM_TILE 16
#define ATT_KEYS 64
// NVRTC compiles without the C headers: infinity from its bit pattern.
#define NEG_INF __int_as_float(0xff800000)
// Dynamic shared memory (a CPU emulation of these kernels for tests defines its own).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// Sum of `v` over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

// out[t][i] = table[ids[t]][i]. Grid: (tokens). The host checked every id against the vocab.
extern "C" __global__ void embed(const unsigned int* ids, const float* table, float* out, int hidden) {
    int t = blockIdx.x;
    const float* row = table + (size_t)ids[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[(size_t)t * hidden + i] = row[i];
}

// out = x / sqrt(mean(x^2) + eps) * w, per row. Grid: (rows).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int hidden, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * hidden;
    float* orow = out + (size_t)blockIdx.x * hidden;
    float s = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s, scratch);
    float inv = 1.0f / sqrtf(s / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) orow[i] = xr[i] * inv * w[i];
}

// c[m][n] (+)= sum_k a[m][k] * w[n][k]: a linear layer without bias. Grid: (ceil(n/16),
// ceil(m/16)), block (16, 16). `accumulate` adds to c (the residual connections).
extern "C" __global__ void matmul_nt(const float* a, const float* w, float* c, int m, int n, int k, int accumulate) {
    __shared__ float as[MM_TILE][MM_TILE + 1];
    __shared__ float ws[MM_TILE][MM_TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int row = blockIdx.y * MM_TILE + ty;
    int col = blockIdx.x * MM_TILE + tx;
    int wrow = blockIdx.x * MM_TILE + ty;
    float acc = 0.0f;
    for (int k0 = 0; k0 < k; k0 += MM_TILE) {
        int kk = k0 + tx;
        as[ty][tx] = (row < m && kk < k) ? a[(size_t)row * k + kk] : 0.0f;
        ws[ty][tx] = (wrow < n && kk < k) ? w[(size_t)wrow * k + kk] : 0.0f;
        __syncthreads();
        for (int i = 0; i < MM_TILE; ++i) acc += as[ty][i] * ws[tx][i];
        __syncthreads();
    }
    if (row < m && col < n) {
        size_t o = (size_t)row * n + col;
        c[o] = accumulate ? c[o] + acc : acc;
    }
}

// matmul_nt for one row (decode): one warp per output. Grid: (ceil(n/8)), block 256.
extern "C" __global__ void gemv_nt(const float* a, const float* w, float* c, int n, int k, int accumulate) {
    int lane = threadIdx.x & 31;
    int col = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (col >= n) return;
    const float* wr = w + (size_t)col * k;
    float acc = 0.0f;
    for (int i = lane; i < k; i += 32) acc += a[i] * wr[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) c[col] = accumulate ? c[col] + acc : acc;
}

// Rotary embedding in place, "rotate half" (Hugging Face Llama): for i < d/2,
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) at position start_pos + t.
// x is [token][head][head_dim]; cos/sin are [position][head_dim / 2]. Grid: (tokens, heads).
extern "C" __global__ void rope(float* x, const float* cos_t, const float* sin_t, int heads, int head_dim, int start_pos) {
    int t = blockIdx.x, h = blockIdx.y, half = head_dim / 2;
    float* v = x + ((size_t)t * heads + h) * head_dim;
    const float* c = cos_t + (size_t)(start_pos + t) * half;
    const float* s = sin_t + (size_t)(start_pos + t) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
    }
}

// Writes K and V of positions start_pos + t ([token][kv_head][head_dim]) into the pool at
// `layer`. Grid: (tokens, kv_heads).
extern "C" __global__ void kv_write(const float* k, const float* v, float* pool, const unsigned int* table,
                                    int layer, int start_pos, int block_tokens, int kv_heads, int head_dim,
                                    long long block_floats) {
    int t = blockIdx.x, kh = blockIdx.y, p = start_pos + t;
    size_t row = (size_t)kv_heads * head_dim;
    size_t base = (size_t)table[p / block_tokens] * (size_t)block_floats + (size_t)(p % block_tokens) * row
                  + (size_t)kh * head_dim;
    size_t k_off = base + (size_t)(2 * layer) * block_tokens * row;
    size_t v_off = base + (size_t)(2 * layer + 1) * block_tokens * row;
    const float* ks = k + (size_t)t * row + (size_t)kh * head_dim;
    const float* vs = v + (size_t)t * row + (size_t)kh * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        pool[k_off + d] = ks[d];
        pool[v_off + d] = vs[d];
    }
}

// Causal GQA attention of query t (position start_pos + t) over positions 0..=start_pos + t,
// read from the paged pool in place, with an online softmax over tiles of ATT_KEYS keys.
// q and out are [token][head][head_dim]. Grid: (tokens, heads); block: at least head_dim
// threads (a multiple of 32); dynamic shared memory: (head_dim + ATT_KEYS) floats.
extern "C" __global__ void attention(const float* q, const float* pool, const unsigned int* table, float* out,
                                     int layer, int start_pos, int heads, int kv_heads, int head_dim,
                                     int block_tokens, long long block_floats, float scale) {
    DYNAMIC_SHARED(float, shared);
    float* qs = shared;
    float* s = shared + head_dim;
    __shared__ float corr_sh, l_sh;
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int kh = h / (heads / kv_heads);
    int n = start_pos + t + 1;
    size_t row = (size_t)kv_heads * head_dim;
    size_t k_off = (size_t)(2 * layer) * block_tokens * row + (size_t)kh * head_dim;
    size_t v_off = (size_t)(2 * layer + 1) * block_tokens * row + (size_t)kh * head_dim;
    const float* qr = q + ((size_t)t * heads + h) * head_dim;
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = qr[d];
    float m = NEG_INF, l = 0.0f, acc = 0.0f;
    __syncthreads();
    for (int j0 = 0; j0 < n; j0 += ATT_KEYS) {
        for (int jj = tid; jj < ATT_KEYS; jj += blockDim.x) {
            int j = j0 + jj;
            float score = NEG_INF;
            if (j < n) {
                const float* kr = pool + (size_t)table[j / block_tokens] * (size_t)block_floats + k_off
                                  + (size_t)(j % block_tokens) * row;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; ++d) dot += qs[d] * kr[d];
                score = dot * scale;
            }
            s[jj] = score;
        }
        __syncthreads();
        if (tid == 0) {
            // j0 < n, so s[0] is finite and so is the new maximum.
            float tile_max = NEG_INF;
            for (int jj = 0; jj < ATT_KEYS; ++jj) tile_max = fmaxf(tile_max, s[jj]);
            float new_m = fmaxf(m, tile_max);
            float corr = expf(m - new_m);
            float sum = 0.0f;
            for (int jj = 0; jj < ATT_KEYS; ++jj) {
                float p = expf(s[jj] - new_m);
                s[jj] = p;
                sum += p;
            }
            l = l * corr + sum;
            m = new_m;
            corr_sh = corr;
        }
        __syncthreads();
        if (tid < head_dim) {
            float a = acc * corr_sh;
            int keys = min(ATT_KEYS, n - j0);
            for (int jj = 0; jj < keys; ++jj) {
                int j = j0 + jj;
                const float* vr = pool + (size_t)table[j / block_tokens] * (size_t)block_floats + v_off
                                  + (size_t)(j % block_tokens) * row;
                a += s[jj] * vr[tid];
            }
            acc = a;
        }
        __syncthreads();
    }
    if (tid == 0) l_sh = l;
    __syncthreads();
    if (tid < head_dim) out[((size_t)t * heads + h) * head_dim + tid] = acc / l_sh;
}

// gate = silu(gate) * up, elementwise over n values. Grid: (ceil(n/256)), block 256.
extern "C" __global__ void silu_mul(float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
