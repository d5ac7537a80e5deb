// Runs every kernel of worker/src/gpu/kernels.cu on the CPU (through cuda_emu.h), with the
// launch shapes of the .cu's comments and of worker/src/gpu/mod.rs, against naive reference
// loops written independently here (in double). Prints `ok <check> max_err=<e>` per check and
// exits non-zero with a message at the first failure. Built and run by
// worker/tests/kernels_emulated.rs.
#include "cuda_emu.h"

#include "../../src/gpu/kernels.cu"

#include <algorithm>
#include <cinttypes>
#include <string>

namespace {

constexpr double kRelTol = 1e-4;
constexpr size_t kGuard = 64;

[[noreturn]] void fail_check(const std::string& msg) {
    std::fflush(stdout);
    std::fprintf(stderr, "FAIL %s\n", msg.c_str());
    std::exit(1);
}

struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed) {}
    uint64_t next() {  // splitmix64
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) { return lo + (hi - lo) * (float)((next() >> 40) * 0x1p-24); }
    unsigned below(unsigned n) { return (unsigned)(next() % n); }
};

// A device-like buffer with guard zones on both sides, filled with a sentinel (NaN for f32):
// a kernel that writes out of bounds is caught by check_guards, one that reads out of bounds
// gets NaN and fails its comparison.
template <class T>
struct Buf {
    std::vector<T> v;
    size_t n;
    explicit Buf(size_t n_) : v(n_ + 2 * kGuard), n(n_) {
        std::memset(v.data(), 0xff, v.size() * sizeof(T));
    }
    T* p() { return v.data() + kGuard; }
    T& operator[](size_t i) { return v[kGuard + i]; }
    const T& operator[](size_t i) const { return v[kGuard + i]; }
    void fill_uniform(Rng& r, float lo = -1.0f, float hi = 1.0f) {
        for (size_t i = 0; i < n; ++i) (*this)[i] = (T)r.uniform(lo, hi);
    }
    void check_guards(const std::string& what) const {
        for (size_t i = 0; i < kGuard; ++i) {
            uint64_t a = 0, b = 0;
            std::memcpy(&a, &v[i], sizeof(T));
            std::memcpy(&b, &v[kGuard + n + i], sizeof(T));
            uint64_t all = sizeof(T) == 8 ? ~0ull : ((1ull << (8 * sizeof(T))) - 1);
            if (a != all) fail_check(what + ": a kernel wrote " + std::to_string(kGuard - i) + " elements before the buffer");
            if (b != all) fail_check(what + ": a kernel wrote " + std::to_string(i) + " elements past the end of the buffer");
        }
    }
};

// Compares `got` with `want` (within kRelTol of max(1, |want|)); NaN fails.
double compare(const std::string& name, const float* got, const std::vector<double>& want) {
    double max_err = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
        double err = std::fabs((double)got[i] - want[i]);
        double tol = kRelTol * std::max(1.0, std::fabs(want[i]));
        if (!(err <= tol)) {
            char buf[256];
            std::snprintf(buf, sizeof buf, "%s: element %zu: got %.9g, expected %.9g (|err| %.3g > tol %.3g)",
                          name.c_str(), i, (double)got[i], want[i], err, tol);
            fail_check(buf);
        }
        max_err = std::max(max_err, err);
    }
    return max_err;
}

void ok(const std::string& name, double max_err) {
    std::printf("ok %s max_err=%.3g\n", name.c_str(), max_err);
    std::fflush(stdout);
}

unsigned ceil_div(unsigned a, unsigned b) { return (a + b - 1) / b; }

// ---- embed: grid (tokens), block 256 (mod.rs forward) ----
void check_embed(int tokens, int vocab, int hidden, uint64_t seed) {
    std::string name = "embed tokens=" + std::to_string(tokens) + " hidden=" + std::to_string(hidden);
    Rng r(seed);
    Buf<unsigned> ids(tokens);
    for (int t = 0; t < tokens; ++t) ids[t] = r.below(vocab);
    Buf<float> table((size_t)vocab * hidden), out((size_t)tokens * hidden);
    table.fill_uniform(r);
    launch(dim3(tokens), dim3(256), 0, [&] { embed(ids.p(), table.p(), out.p(), hidden); });
    out.check_guards(name);
    std::vector<double> want((size_t)tokens * hidden);
    for (int t = 0; t < tokens; ++t)
        for (int i = 0; i < hidden; ++i) want[(size_t)t * hidden + i] = table[(size_t)ids[t] * hidden + i];
    ok(name, compare(name, out.p(), want));
}

// ---- rms_norm: grid (rows), block 256 (GpuModel::rms_norm) ----
void check_rms_norm(int rows, int hidden, uint64_t seed) {
    std::string name = "rms_norm rows=" + std::to_string(rows) + " hidden=" + std::to_string(hidden);
    Rng r(seed);
    const float eps = 1e-5f;
    Buf<float> x((size_t)rows * hidden), w(hidden), out((size_t)rows * hidden);
    x.fill_uniform(r, -2.0f, 2.0f);
    w.fill_uniform(r, 0.5f, 1.5f);
    launch(dim3(rows), dim3(256), 0, [&] { rms_norm(x.p(), w.p(), out.p(), hidden, eps); });
    out.check_guards(name);
    std::vector<double> want((size_t)rows * hidden);
    for (int row = 0; row < rows; ++row) {
        double ss = 0.0;
        for (int i = 0; i < hidden; ++i) ss += (double)x[(size_t)row * hidden + i] * x[(size_t)row * hidden + i];
        double inv = 1.0 / std::sqrt(ss / hidden + (double)eps);
        for (int i = 0; i < hidden; ++i)
            want[(size_t)row * hidden + i] = x[(size_t)row * hidden + i] * inv * w[i];
    }
    ok(name, compare(name, out.p(), want));
}

// Reference of both linear kernels: c[m][n] (+)= sum_k a[m][k] * w[n][k].
std::vector<double> linear_ref(const Buf<float>& a, const Buf<float>& w, const std::vector<float>& c0, int m, int n,
                               int k, bool accumulate) {
    std::vector<double> c((size_t)m * n);
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
            double s = 0.0;
            for (int kk = 0; kk < k; ++kk) s += (double)a[(size_t)i * k + kk] * w[(size_t)j * k + kk];
            c[(size_t)i * n + j] = (accumulate ? (double)c0[(size_t)i * n + j] : 0.0) + s;
        }
    return c;
}

// ---- matmul_nt: grid (ceil(n/16), ceil(m/16)), block (16, 16) (GpuModel::linear, m > 1) ----
void check_matmul(int m, int n, int k, bool accumulate, uint64_t seed) {
    std::string name = "matmul_nt m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                       (accumulate ? " accumulate" : "");
    Rng r(seed);
    Buf<float> a((size_t)m * k), w((size_t)n * k), c((size_t)m * n);
    a.fill_uniform(r);
    w.fill_uniform(r);
    if (accumulate) c.fill_uniform(r);  // otherwise NaN: every element must be overwritten
    std::vector<float> c0(c.p(), c.p() + c.n);
    launch(dim3(ceil_div(n, 16), ceil_div(m, 16)), dim3(16, 16), 0,
           [&] { matmul_nt(a.p(), w.p(), c.p(), m, n, k, accumulate ? 1 : 0); });
    c.check_guards(name);
    ok(name, compare(name, c.p(), linear_ref(a, w, c0, m, n, k, accumulate)));
}

// ---- gemv_nt: grid (ceil(n/8)), block 256 (GpuModel::linear, m == 1) ----
void check_gemv(int n, int k, bool accumulate, uint64_t seed) {
    std::string name = "gemv_nt n=" + std::to_string(n) + " k=" + std::to_string(k) + (accumulate ? " accumulate" : "");
    Rng r(seed);
    Buf<float> a(k), w((size_t)n * k), c(n);
    a.fill_uniform(r);
    w.fill_uniform(r);
    if (accumulate) c.fill_uniform(r);
    std::vector<float> c0(c.p(), c.p() + c.n);
    launch(dim3(ceil_div(n, 8)), dim3(256), 0, [&] { gemv_nt(a.p(), w.p(), c.p(), n, k, accumulate ? 1 : 0); });
    c.check_guards(name);
    ok(name, compare(name, c.p(), linear_ref(a, w, c0, 1, n, k, accumulate)));
}

// ---- rope: grid (tokens, heads), block 64 (GpuModel::rope) ----
void check_rope(int tokens, int heads, int head_dim, int start_pos, uint64_t seed) {
    std::string name = "rope tokens=" + std::to_string(tokens) + " heads=" + std::to_string(heads) +
                       " head_dim=" + std::to_string(head_dim) + " start_pos=" + std::to_string(start_pos);
    Rng r(seed);
    int half = head_dim / 2, positions = start_pos + tokens + 3;
    Buf<float> x((size_t)tokens * heads * head_dim), cos_t((size_t)positions * half), sin_t((size_t)positions * half);
    x.fill_uniform(r);
    for (int p = 0; p < positions; ++p)
        for (int i = 0; i < half; ++i) {
            double theta = p * std::pow(10000.0, -2.0 * i / head_dim) + r.uniform(0.0f, 0.1f);
            cos_t[(size_t)p * half + i] = (float)std::cos(theta);
            sin_t[(size_t)p * half + i] = (float)std::sin(theta);
        }
    std::vector<float> x0(x.p(), x.p() + x.n);
    launch(dim3(tokens, heads), dim3(64), 0,
           [&] { rope(x.p(), cos_t.p(), sin_t.p(), heads, head_dim, start_pos); });
    x.check_guards(name);
    std::vector<double> want(x.n);
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h) {
            size_t base = ((size_t)t * heads + h) * head_dim;
            size_t pos = (size_t)(start_pos + t) * half;
            for (int i = 0; i < head_dim; ++i) {
                // rotate_half: x * cos + rotate_half(x) * sin, cos/sin repeated over both halves.
                double c = cos_t[pos + i % half], s = sin_t[pos + i % half];
                double rot = i < half ? -(double)x0[base + i + half] : (double)x0[base + i - half];
                want[base + i] = x0[base + i] * c + rot * s;
            }
        }
    ok(name, compare(name, x.p(), want));
}

// The paged pool, laid out [block][layer][K|V][token][kv_head][head_dim].
struct Pool {
    int layers, block_tokens, kv_heads, head_dim, blocks;
    long long block_floats;
    std::vector<unsigned> table;  // position p -> block table[p / block_tokens]
    Buf<float> buf;
    Pool(int layers_, int block_tokens_, int kv_heads_, int head_dim_, int blocks_, int table_len, Rng& r)
        : layers(layers_), block_tokens(block_tokens_), kv_heads(kv_heads_), head_dim(head_dim_), blocks(blocks_),
          block_floats((long long)layers_ * 2 * block_tokens_ * kv_heads_ * head_dim_),
          buf((size_t)blocks_ * layers_ * 2 * block_tokens_ * kv_heads_ * head_dim_) {
        // A shuffled table over distinct blocks, never the identity.
        std::vector<unsigned> ids(blocks);
        for (int i = 0; i < blocks; ++i) ids[i] = (unsigned)i;
        for (int i = blocks - 1; i > 0; --i) std::swap(ids[i], ids[r.below(i + 1)]);
        if (ids[0] == 0) std::swap(ids[0], ids[blocks - 1]);
        table.assign(ids.begin(), ids.begin() + table_len);
        buf.fill_uniform(r);
    }
    // Index of element d of kv head kh of position p, K (kv = 0) or V (kv = 1), at `layer`.
    size_t at(int layer, int kv, int p, int kh, int d) const {
        size_t block = table[p / block_tokens], slot = p % block_tokens;
        return block * (size_t)block_floats +
               ((((size_t)layer * 2 + kv) * block_tokens + slot) * kv_heads + kh) * head_dim + d;
    }
    float get(int layer, int kv, int p, int kh, int d) const { return buf[at(layer, kv, p, kh, d)]; }
};

// ---- kv_write: grid (tokens, kv_heads), block 64 (mod.rs forward) ----
void check_kv_write(int tokens, int start_pos, int layer, int layers, int block_tokens, int kv_heads, int head_dim,
                    uint64_t seed) {
    std::string name = "kv_write tokens=" + std::to_string(tokens) + " start_pos=" + std::to_string(start_pos) +
                       " layer=" + std::to_string(layer) + " head_dim=" + std::to_string(head_dim);
    Rng r(seed);
    int table_len = ceil_div(start_pos + tokens, block_tokens);
    Pool pool(layers, block_tokens, kv_heads, head_dim, table_len + 3, table_len, r);
    Buf<unsigned> table(table_len);
    for (int i = 0; i < table_len; ++i) table[i] = pool.table[i];
    size_t row = (size_t)kv_heads * head_dim;
    Buf<float> k(tokens * row), v(tokens * row);
    k.fill_uniform(r, 2.0f, 3.0f);  // unlike anything in the pool
    v.fill_uniform(r, -3.0f, -2.0f);
    std::vector<float> before(pool.buf.p(), pool.buf.p() + pool.buf.n);
    launch(dim3(tokens, kv_heads), dim3(64), 0, [&] {
        kv_write(k.p(), v.p(), pool.buf.p(), table.p(), layer, start_pos, block_tokens, kv_heads, head_dim,
                 pool.block_floats);
    });
    pool.buf.check_guards(name);
    // Read back by position; everything else in the pool is untouched.
    std::vector<double> want(before.begin(), before.end());
    for (int t = 0; t < tokens; ++t)
        for (int kh = 0; kh < kv_heads; ++kh)
            for (int d = 0; d < head_dim; ++d) {
                want[pool.at(layer, 0, start_pos + t, kh, d)] = k[t * row + kh * head_dim + d];
                want[pool.at(layer, 1, start_pos + t, kh, d)] = v[t * row + kh * head_dim + d];
            }
    ok(name, compare(name, pool.buf.p(), want));
}

// ---- attention: grid (tokens, heads), block max(64, head_dim rounded up to 32), dynamic
// shared memory (head_dim + 64) * 4 bytes (mod.rs forward) ----
void check_attention(int tokens, int start_pos, int heads, int kv_heads, int head_dim, int layer, int layers,
                     int block_tokens, uint64_t seed) {
    std::string name = "attention tokens=" + std::to_string(tokens) + " start_pos=" + std::to_string(start_pos) +
                       " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                       " head_dim=" + std::to_string(head_dim) + " layer=" + std::to_string(layer) +
                       " block_tokens=" + std::to_string(block_tokens);
    Rng r(seed);
    int table_len = ceil_div(start_pos + tokens, block_tokens);
    Pool pool(layers, block_tokens, kv_heads, head_dim, table_len + 2, table_len, r);
    Buf<unsigned> table(table_len);
    for (int i = 0; i < table_len; ++i) table[i] = pool.table[i];
    Buf<float> q((size_t)tokens * heads * head_dim), out((size_t)tokens * heads * head_dim);
    q.fill_uniform(r, -3.0f, 3.0f);  // peaky enough that the softmax is far from uniform
    float scale = 1.0f / std::sqrt((float)head_dim);
    unsigned threads = std::max(64u, ceil_div(head_dim, 32) * 32);
    size_t shared = (size_t)(head_dim + 64) * 4;
    launch(dim3(tokens, heads), dim3(threads), shared, [&] {
        attention(q.p(), pool.buf.p(), table.p(), out.p(), layer, start_pos, heads, kv_heads, head_dim, block_tokens,
                  pool.block_floats, scale);
    });
    out.check_guards(name);
    std::vector<double> want(out.n);
    int group = heads / kv_heads;
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h) {
            int kh = h / group, n = start_pos + t + 1;
            const float* qr = q.p() + ((size_t)t * heads + h) * head_dim;
            std::vector<double> score(n);
            double mx = -INFINITY;
            for (int p = 0; p < n; ++p) {
                double dot = 0.0;
                for (int d = 0; d < head_dim; ++d) dot += (double)qr[d] * pool.get(layer, 0, p, kh, d);
                score[p] = dot * scale;
                mx = std::max(mx, score[p]);
            }
            double sum = 0.0;
            for (int p = 0; p < n; ++p) sum += (score[p] = std::exp(score[p] - mx));
            for (int d = 0; d < head_dim; ++d) {
                double o = 0.0;
                for (int p = 0; p < n; ++p) o += score[p] * pool.get(layer, 1, p, kh, d);
                want[((size_t)t * heads + h) * head_dim + d] = o / sum;
            }
        }
    ok(name, compare(name, out.p(), want));
}

// ---- silu_mul: grid (ceil(n/256)), block 256 (mod.rs forward) ----
void check_silu_mul(long long n, uint64_t seed) {
    std::string name = "silu_mul n=" + std::to_string(n);
    Rng r(seed);
    Buf<float> gate(n), up(n);
    gate.fill_uniform(r, -8.0f, 8.0f);
    up.fill_uniform(r, -2.0f, 2.0f);
    std::vector<float> g0(gate.p(), gate.p() + n);
    launch(dim3(ceil_div((unsigned)n, 256)), dim3(256), 0, [&] { silu_mul(gate.p(), up.p(), n); });
    gate.check_guards(name);
    std::vector<double> want(n);
    for (long long i = 0; i < n; ++i) want[i] = (double)g0[i] / (1.0 + std::exp(-(double)g0[i])) * up[i];
    ok(name, compare(name, gate.p(), want));
}

}  // namespace

int main() {
    check_embed(5, 50, 300, 1);
    check_embed(3, 7, 40, 2);

    check_rms_norm(3, 300, 3);
    check_rms_norm(2, 40, 4);
    check_rms_norm(1, 256, 5);

    check_matmul(19, 37, 45, false, 6);
    check_matmul(19, 37, 45, true, 7);
    check_matmul(2, 20, 33, true, 8);
    check_matmul(32, 16, 16, false, 9);

    check_gemv(37, 45, false, 10);
    check_gemv(37, 45, true, 11);
    check_gemv(13, 20, false, 12);
    check_gemv(16, 64, true, 13);

    check_rope(3, 4, 48, 5, 14);
    check_rope(2, 2, 160, 0, 15);

    check_kv_write(7, 5, 2, 3, 4, 2, 48, 16);
    check_kv_write(3, 0, 0, 2, 8, 1, 96, 17);

    // Several 64-key tiles with a last partial one; n = 127..130 crosses a tile edge exactly
    // (n = 128) and leaves a one-key tile (n = 129).
    check_attention(4, 126, 4, 2, 32, 1, 2, 16, 18);
    // head_dim not a multiple of 32 (48: 64 threads, 16 idle in the V sum), GQA groups of 3.
    check_attention(2, 150, 6, 2, 48, 2, 3, 8, 19);
    // Prefill from 0 (one partial tile), head_dim 80 (96 threads, three warps).
    check_attention(5, 0, 2, 1, 80, 1, 2, 4, 20);

    check_silu_mul(1000, 21);
    check_silu_mul(256, 22);

    std::printf("all kernels ok\n");
    return 0;
}
