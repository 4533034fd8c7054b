/* Split-K decoding on the CPU (flash-decoding): a few float32 queries against a long K/V cache.
 *
 * Built on first use by variants/decode_kernel.py with the system's C compiler (-O3 -march=native
 * -ffast-math -fopenmp) and called through ctypes on the tensors' memory; nothing here knows torch.
 *
 * Layout: `bh` independent (batch, K/V head) pairs. For pair p:
 *   q   rows p*R .. p*R+R-1 of a (bh*R, D) row-major array: the R = G*Nq query rows that share the
 *       pair's K/V head (G query heads per K/V head, Nq queries each; row r is query r % Nq);
 *   k   n rows of D floats from k + p*k_pair, row stride k_row (elements; the last dim contiguous);
 *   v   n rows of Dv floats, the same way;
 *   out rows p*R .. of a (bh*R, Dv) row-major array.
 * Causal: query i (of Nq) sees keys j <= n - nq + i (bottom-right, as the suite's causal).
 *
 * The keys of each pair are split into `splits` contiguous ranges; every (pair, range) is one task
 * of an OpenMP loop, so the cache is read once, by all threads, whatever the number of pairs. A task
 * walks its range in tiles of TILE keys with an online softmax (running max m, sum l and weighted
 * sum acc per row) and leaves (m, l, acc); the ranges of a pair are then merged by log-sum-exp.
 * sinks (or NULL): one logit per query row, (bh*R) like out's rows, that joins the row's softmax for
 * a zero value (gpt-oss): it enters the merge as one more range with m = sink, l = 1, acc = 0.
 * Time O(bh R n (D + Dv)); memory O(bh splits R Dv) besides the inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32
#define MAX_ROWS 64
#define MAX_DIM 256

/* VL floats, loaded and stored at any alignment, in the target's widest vector registers (a vector
 * wider than the target's is split by the compiler into pieces that spill the accumulators) */
#if defined(__AVX512F__)
#define VB 64
#elif defined(__AVX__)
#define VB 32
#else
#define VB 16
#endif
typedef float vf __attribute__((vector_size(VB), aligned(4)));
#define VL (VB / 4)

static inline float hsum(vf x) {
    float t = 0.0f;
    for (int i = 0; i < VL; i++) t += x[i];
    return t;
}

/* s[r][t] = scale * q_r . k_t for rows r0 .. r0+nr-1 (nr <= 8) of one key: eight independent
 * accumulators held in registers (a fixed count: rows past the last repeat it, unstored), so the
 * FMAs pipeline instead of waiting on one another */
static inline void dots(const float *q, const float *kt, int r0, int nr, int D, float scale, int t,
                        float s[][TILE]) {
    const float *qp[8];
    for (int i = 0; i < 8; i++) qp[i] = q + (long)(r0 + (i < nr ? i : nr - 1)) * D;
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    int d = 0;
    for (; d + VL <= D; d += VL) {
        vf kv = *(const vf *)(kt + d);
        a0 += *(const vf *)(qp[0] + d) * kv;
        a1 += *(const vf *)(qp[1] + d) * kv;
        a2 += *(const vf *)(qp[2] + d) * kv;
        a3 += *(const vf *)(qp[3] + d) * kv;
        a4 += *(const vf *)(qp[4] + d) * kv;
        a5 += *(const vf *)(qp[5] + d) * kv;
        a6 += *(const vf *)(qp[6] + d) * kv;
        a7 += *(const vf *)(qp[7] + d) * kv;
    }
    float out[8] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(a4), hsum(a5), hsum(a6), hsum(a7)};
    for (int i = 0; i < nr; i++) {
        float tail = 0.0f;
        for (int dd = d; dd < D; dd++) tail += qp[i][dd] * kt[dd];
        s[r0 + i][t] = (out[i] + tail) * scale;
    }
}

static void task(const float *q, const float *k, const float *v, long n, long j0, long j1, int R,
                 int nq, int D, int Dv, long k_row, long v_row, float scale, int causal, float *m,
                 float *l, float *acc) {
    float s[MAX_ROWS][TILE];
    long limit_off = n - nq; /* query i sees keys j <= limit_off + i */
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(acc + (long)r * Dv, 0, sizeof(float) * Dv);
    }
    for (long t0 = j0; t0 < j1; t0 += TILE) {
        int tn = (int)(j1 - t0 < TILE ? j1 - t0 : TILE);
        /* scores of the tile, each key row read once for all the rows */
        for (int t = 0; t < tn; t++) {
            const float *kt = k + (t0 + t) * k_row;
            for (int r0 = 0; r0 < R; r0 += 8) dots(q, kt, r0, R - r0 < 8 ? R - r0 : 8, D, scale, t, s);
        }
        if (causal) {
            for (int r = 0; r < R; r++) {
                long last = limit_off + r % nq; /* the query's own position */
                for (int t = 0; t < tn; t++)
                    if (t0 + t > last) s[r][t] = -INFINITY;
            }
        }
        /* online softmax: rescale what the row has, add the tile (p = 0 where masked) */
        for (int r = 0; r < R; r++) {
            float mt = -INFINITY;
            for (int t = 0; t < tn; t++) mt = s[r][t] > mt ? s[r][t] : mt;
            if (mt == -INFINITY) { /* no key of this tile is visible to the row */
                for (int t = 0; t < tn; t++) s[r][t] = 0.0f;
                continue;
            }
            float mn = m[r] > mt ? m[r] : mt;
            float corr = expf(m[r] - mn); /* 0 for the first visible tile (m = -inf) */
            float sum = 0.0f;
            for (int t = 0; t < tn; t++) {
                s[r][t] = expf(s[r][t] - mn);
                sum += s[r][t];
            }
            l[r] = l[r] * corr + sum;
            m[r] = mn;
            float *ar = acc + (long)r * Dv;
            if (corr != 1.0f)
                for (int d = 0; d < Dv; d++) ar[d] *= corr;
        }
        /* acc_r += sum_t p[r][t] v_t: four vectors of a row's acc stay in registers over the tile's
         * keys (four independent chains), the tile's value rows are re-read from L1 */
        for (int r = 0; r < R; r++) {
            float *ar = acc + (long)r * Dv;
            int d = 0;
            for (; d + 4 * VL <= Dv; d += 4 * VL) {
                vf a0 = *(vf *)(ar + d), a1 = *(vf *)(ar + d + VL), a2 = *(vf *)(ar + d + 2 * VL),
                   a3 = *(vf *)(ar + d + 3 * VL);
                for (int t = 0; t < tn; t++) {
                    const float *vt = v + (t0 + t) * v_row + d;
                    float p = s[r][t];
                    a0 += p * *(const vf *)vt;
                    a1 += p * *(const vf *)(vt + VL);
                    a2 += p * *(const vf *)(vt + 2 * VL);
                    a3 += p * *(const vf *)(vt + 3 * VL);
                }
                *(vf *)(ar + d) = a0;
                *(vf *)(ar + d + VL) = a1;
                *(vf *)(ar + d + 2 * VL) = a2;
                *(vf *)(ar + d + 3 * VL) = a3;
            }
            for (; d < Dv; d++) {
                float a = ar[d];
                for (int t = 0; t < tn; t++) a += s[r][t] * v[(t0 + t) * v_row + d];
                ar[d] = a;
            }
        }
    }
}

/* Returns 0, or -1 if a size is outside what this kernel takes (the caller falls back). */
int decode_splitk(const float *q, const float *k, const float *v, float *out, long bh, int R, int nq,
                  long n, int D, int Dv, long k_pair, long k_row, long v_pair, long v_row, float scale,
                  int causal, int splits, int threads, const float *sinks) {
    if (R > MAX_ROWS || D > MAX_DIM || Dv > MAX_DIM || n < 1 || splits < 1 || R % nq) return -1;
    long per = (n + splits - 1) / splits;
    long tasks = bh * splits;
    float *ms = malloc(sizeof(float) * tasks * R);
    float *ls = malloc(sizeof(float) * tasks * R);
    float *accs = malloc(sizeof(float) * tasks * R * Dv);
    if (!ms || !ls || !accs) {
        free(ms);
        free(ls);
        free(accs);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long x = 0; x < tasks; x++) {
        long p = x / splits, sidx = x % splits;
        long j0 = sidx * per, j1 = j0 + per < n ? j0 + per : n;
        if (j0 >= j1) {
            for (int r = 0; r < R; r++) {
                ms[x * R + r] = -INFINITY;
                ls[x * R + r] = 0.0f;
            }
            continue;
        }
        task(q + p * R * D, k + p * k_pair, v + p * v_pair, n, j0, j1, R, nq, D, Dv, k_row, v_row, scale,
             causal, ms + x * R, ls + x * R, accs + x * R * Dv);
    }
    /* merge the ranges of each pair by log-sum-exp; a row that saw no key is zero */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long pr = 0; pr < bh * R; pr++) {
        long p = pr / R;
        int r = (int)(pr % R);
        float sink = sinks ? sinks[pr] : -INFINITY;
        float mx = sink;
        for (int sidx = 0; sidx < splits; sidx++) {
            float mm = ms[(p * splits + sidx) * R + r];
            mx = mm > mx ? mm : mx;
        }
        float *o = out + pr * Dv;
        memset(o, 0, sizeof(float) * Dv);
        if (mx == -INFINITY) continue;
        float denom = sinks ? expf(sink - mx) : 0.0f; /* the sink's term, for a zero value */
        for (int sidx = 0; sidx < splits; sidx++) {
            long x = p * splits + sidx;
            float mm = ms[x * R + r];
            if (mm == -INFINITY) continue;
            float w = expf(mm - mx);
            denom += ls[x * R + r] * w;
            const float *a = accs + (x * R + r) * Dv;
            for (int d = 0; d < Dv; d++) o[d] += w * a[d];
        }
        for (int d = 0; d < Dv; d++) o[d] /= denom;
    }
    free(ms);
    free(ls);
    free(accs);
    return 0;
}
