// One sublayer's residual seam (`reference.delta_residual` with a single linear gate and a learned value): the gate,
// the value and the delta update, forward and backward, in one pass over each token's rows (ddl_kernels/residual);
// optionally with the next compressor's readout of the new state (CC: one tap; TC: K taps over the tokens),
// y[t, i] = sum_s sum_j w_r[s, j, i] X_next[t - (K-1) + s, j, i], which then costs no pass of its own over the state
// (forward or backward).
#include "common.h"

namespace ddl {

// y[t] of the readout from the new states out[t - (K-1) .. t] of its sequence (p: t's position in it), in the
// order of readout_forward (taps, then rows): wherever it is computed, the same sums.
template <typename T>
inline void readout_of(const T* out, const T* wr, int64_t t, int64_t p, int64_t k, int64_t rows, int64_t d, T* y) {
  T* yt = y + t * d;
  bool first = true;
  for (int64_t s = std::max<int64_t>(0, k - 1 - p); s < k; ++s) {
    const T* xs = out + (t - (k - 1) + s) * rows * d;
    for (int64_t j = 0; j < rows; ++j) {
      const T* xj = xs + j * d; const T* wj = wr + (s * rows + j) * d;
      if (first) {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) yt[i] = wj[i] * xj[i];
        first = false;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) yt[i] += wj[i] * xj[i];
      }
    }
  }
}

// u_kind: 0 = u is its own tensor, 1 = u is c (value from the normalised input), 2 = u is the d_v = 1 state X.
// NV: d_v when it is 1, 2, 4 or 8 (compiled for each: the loops over a token's d_v rows have a known count), or 0:
// d_v = nv at run time.
template <typename T, int NV>
void seam_forward(const T* x, const T* h, const T* c, const T* u, const T* wb, T bb, const T* wv, const T* bv,
                  double scale, double eps, bool erase, int64_t n, int64_t nv, int64_t d, T* out, T* beta_out,
                  T* v_out, T* s_out, T* hx_out, T* w_out, const T* wr, T* y, int64_t k, int64_t len, int threads) {
  const int64_t rows = NV > 0 ? NV : nv;
  std::mutex lock;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (with a readout) the chunks of tokens, for their first K-1
  parallel_for(n, 16, threads, [&](int64_t begin, int64_t end) {
    if (wr) { std::lock_guard<std::mutex> guard(lock); chunks.emplace_back(begin, end); }
    std::vector<T> coef(rows), ys(rows), hxs(rows, T(0));
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * rows * d; const T* ht = h + t * d; const T* ct = c + t * d; const T* ut = u + t * d;
      const T z = dot(ct, wb, d), hh = dot(ht, ht, d);
      row_dots(ut, wv, d, rows, ys.data());
      if (erase) row_dots(ht, xt, d, rows, hxs.data());
      const T beta = T(2) / (T(1) + std::exp(-(z + bb)));
      const T s = T(1) / std::sqrt(hh + T(eps * eps));
      for (int64_t j = 0; j < rows; ++j) {
        const T y = ys[j] + bv[j], hx = hxs[j];
        const T v = scale > 0 ? T(scale) / (T(1) + std::exp(-y)) : y;
        coef[j] = beta * s * (v - s * hx);
        if (v_out) { v_out[t * rows + j] = v; hx_out[t * rows + j] = hx; w_out[t * rows + j] = coef[j]; }
      }
      if (beta_out) { beta_out[t] = beta; s_out[t] = s; }
      T* ot = out + t * rows * d;
      for (int64_t j = 0; j < rows; ++j) {
        const T* xj = xt + j * d; T* oj = ot + j * d; const T cj = coef[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) oj[i] = xj[i] + ht[i] * cj;
      }
      // the readout, while this token's rows (and the K-1 before it) are in cache; a token that reads rows of the
      // chunk before this one waits for the loop below
      const int64_t p = t % len;
      if (wr && t - std::min(p, k - 1) >= begin) readout_of(out, wr, t, p, k, rows, d, y);
    }
  });
  for (const auto& chunk : chunks)
    for (int64_t t = chunk.first; t < std::min(chunk.second, chunk.first + k - 1); ++t) {
      const int64_t p = t % len;
      if (t - std::min(p, k - 1) < chunk.first) readout_of(out, wr, t, p, k, rows, d, y);
    }
}

template <typename T, int NV>
void seam_backward(const T* g, const T* x, const T* h, const T* c, const T* u, const T* wb, const T* wv,
                   const T* beta_s, const T* v_s, const T* s_s, const T* hx_s, double scale, bool erase, int64_t u_kind,
                   int64_t n, int64_t nv, int64_t d, T* gx, T* gh, T* gc, T* gu, T* gwb, T* gbb, T* gwv, T* gbv,
                   const T* gy, const T* wr, T* gwr, int64_t k, int64_t len, int threads) {
  const int64_t rows = NV > 0 ? NV : nv;
  const int64_t fields = d + 1 + rows * d + rows;  // the weight gradients: dw, db, dW_v, db_v (then dW_r)
  const int64_t width = fields + (gy ? k * rows * d : 0);
  const auto total = sum_over_tokens<T>(n, width, threads, [&](int64_t t, T* partial) {
    T* awb = partial; T* awv = awb + d + 1;
    thread_local std::vector<T> scratch;  // per-token numbers of each row (one buffer per thread, kept)
    scratch.resize(4 * rows + (gy ? rows * d : 0));
    T* b = scratch.data(); T* a_g = b + rows; T* a_x = a_g + rows; T* dy = a_x + rows;
    const T* gt = g + t * rows * d; const T* xt = x + t * rows * d; const T* ht = h + t * d;
    // (with a readout) output t + (K-1) - s of the sequence reads this token through tap s, for s >= s0
    const int64_t s0 = gy ? std::max<int64_t>(0, t % len + k - len) : 0;
    if (gy) {  // the state's whole gradient: G_j + sum_s w_r[s, j] g_y (the readout's, never a tensor of its own),
      T* gsum = dy + rows;  // the sum first, as readout_backward makes it, then added as autograd adds the two
      for (int64_t s = s0; s < k; ++s) {
        const T* gys = gy + (t + (k - 1) - s) * d; const T* ws = wr + s * rows * d;
        for (int64_t j = 0; j < rows * d; j += d)
          if (s == s0) {
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) gsum[j + i] = ws[j + i] * gys[i];
          } else {
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) gsum[j + i] += ws[j + i] * gys[i];
          }
      }
#pragma omp simd
      for (int64_t q = 0; q < rows * d; ++q) gsum[q] += gt[q];
      gt = gsum;
    }
    const T* ct = c + t * d; const T* ut = u + t * d;
    const T beta = beta_s[t], s = s_s[t];
    row_dots(ht, gt, d, rows, b);
    T dbeta = 0, h_dot = 0;
    for (int64_t j = 0; j < rows; ++j) {
      const T v = v_s[t * rows + j], hx = erase ? hx_s[t * rows + j] : T(0);
      const T tj = v - s * hx, cj = s * b[j];
      dbeta += cj * tj;
      h_dot += b[j] * tj - hx * cj;
      a_g[j] = s * beta * tj;                      // dh += G_j a_g
      a_x[j] = erase ? s * beta * cj : T(0);       // dh -= X_j a_x,  dX_j = G_j - h a_x
      const T dv = beta * cj;
      dy[j] = scale > 0 ? dv * v * (T(1) - v / T(scale)) : dv;
    }
    const T a_h = s * s * s * beta * h_dot;       // dh -= h a_h
    const T dz = dbeta * beta * (T(1) - beta / T(2));
    T* ght = gh + t * d; T* gxt = gx + t * rows * d; T* gct = gc + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) { ght[i] = -ht[i] * a_h; gct[i] = dz * wb[i]; awb[i] += dz * ct[i]; }
    // the value's input gradient: into dc (u = c), dX (u = the d_v = 1 state) or its own tensor
    T* gut = u_kind == 1 ? gct : (u_kind == 2 ? gxt : gu + t * d);
    if (u_kind == 0) for (int64_t i = 0; i < d; ++i) gut[i] = 0;
    for (int64_t j = 0; j < rows; ++j) {
      const T* gj = gt + j * d; const T* xj = xt + j * d; T* gxj = gxt + j * d;
      const T agj = a_g[j], axj = a_x[j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        ght[i] += gj[i] * agj - xj[i] * axj;
        gxj[i] = gj[i] - ht[i] * axj;
      }
    }
    for (int64_t j = 0; j < rows; ++j) {
      const T* wj = wv + j * d; T* awj = awv + j * d; const T dyj = dy[j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) { gut[i] += dyj * wj[i]; awj[i] += dyj * ut[i]; }
    }
    awb[d] += dz;
    for (int64_t j = 0; j < rows; ++j) awv[rows * d + j] += dy[j];
    if (!gy) return;
    // dW_r[s, j] += X_next_j g_y[t + (K-1) - s], X_next_j = X_j + h (beta s t_j) recomputed as forward did
    for (int64_t s = s0; s < k; ++s) {
      const T* gys = gy + (t + (k - 1) - s) * d; T* awr = partial + fields + s * rows * d;
      for (int64_t j = 0; j < rows; ++j) {
        const T* xj = xt + j * d; T* awj = awr + j * d; const T cj = a_g[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) awj[i] += (xj[i] + ht[i] * cj) * gys[i];
      }
    }
  });
  for (int64_t q = fields; q < width; ++q) gwr[q - fields] = T(total[q]);
  for (int64_t q = 0; q < fields; ++q) {
    T* dst = q < d ? gwb + q
                   : (q == d ? gbb : (q < d + 1 + rows * d ? gwv + (q - d - 1) : gbv + (q - d - 1 - rows * d)));
    *dst = T(total[q]);
  }
}

// Runs kernel<NV> for d_v = nv: compiled for 1, 2, 4 and 8, any other at run time.
#define DDL_BY_ROWS(nv, kernel, ...)           \
  switch (nv) {                                \
    case 1: kernel<T, 1>(__VA_ARGS__); break;  \
    case 2: kernel<T, 2>(__VA_ARGS__); break;  \
    case 4: kernel<T, 4>(__VA_ARGS__); break;  \
    case 8: kernel<T, 8>(__VA_ARGS__); break;  \
    default: kernel<T, 0>(__VA_ARGS__);        \
  }

}  // namespace ddl

// n tokens of d numbers, d_v = nv rows each. stats (or null: nothing saved) gets beta (n), s (n), v (n nv) and h.X
// (n nv), write (null with it) the coefficients; wr (K, nv, d) or null: no readout into y; len: the tokens of each
// sequence (the readout's). T: double when f64, else float; threads: the caller's thread count.
struct ResidualForward {
  int64_t f64, threads;
  const void *x, *h, *c, *u, *wb, *bb, *wv, *bv;
  double scale, eps;
  int64_t erase, n, nv, d;
  void *out, *stats, *write;
  const void* wr;
  void* y;
  int64_t k, len;
};

extern "C" void ddl_residual_forward(const void* packed) {
  const auto a = ddl::unpack<ResidualForward>(packed);
  const int64_t n = a.n, nv = a.nv;
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    T* st = static_cast<T*>(a.stats);
    DDL_BY_ROWS(nv, ddl::seam_forward, ddl::in<T>(a.x), ddl::in<T>(a.h), ddl::in<T>(a.c), ddl::in<T>(a.u),
                ddl::in<T>(a.wb), *ddl::in<T>(a.bb), ddl::in<T>(a.wv), ddl::in<T>(a.bv), a.scale, a.eps, a.erase != 0,
                n, nv, a.d, static_cast<T*>(a.out), st, st ? st + 2 * n : nullptr, st ? st + n : nullptr,
                st ? st + 2 * n + n * nv : nullptr, static_cast<T*>(a.write), ddl::in<T>(a.wr), static_cast<T*>(a.y),
                a.k, a.len, int(a.threads));
  });
}

// u_kind as seam_backward's; gu null unless u_kind is 0; gy (n, d) with wr (K, nv, d) and gwr, or all three null.
struct ResidualBackward {
  int64_t f64, threads;
  const void *g, *x, *h, *c, *u, *wb, *wv, *stats;
  double scale;
  int64_t erase, u_kind, n, nv, d;
  void *gx, *gh, *gc, *gu, *gwb, *gbb, *gwv, *gbv;
  const void *gy, *wr;
  void* gwr;
  int64_t k, len;
};

extern "C" void ddl_residual_backward(const void* packed) {
  const auto a = ddl::unpack<ResidualBackward>(packed);
  const int64_t n = a.n, nv = a.nv;
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    const T* st = ddl::in<T>(a.stats);
    DDL_BY_ROWS(nv, ddl::seam_backward, ddl::in<T>(a.g), ddl::in<T>(a.x), ddl::in<T>(a.h), ddl::in<T>(a.c),
                ddl::in<T>(a.u), ddl::in<T>(a.wb), ddl::in<T>(a.wv), st, st + 2 * n, st + n, st + 2 * n + n * nv,
                a.scale, a.erase != 0, a.u_kind, n, nv, a.d, static_cast<T*>(a.gx), static_cast<T*>(a.gh),
                static_cast<T*>(a.gc), static_cast<T*>(a.gu), static_cast<T*>(a.gwb), static_cast<T*>(a.gbb),
                static_cast<T*>(a.gwv), static_cast<T*>(a.gbv), ddl::in<T>(a.gy), ddl::in<T>(a.wr),
                static_cast<T*>(a.gwr), a.k, a.len, int(a.threads));
  });
}
