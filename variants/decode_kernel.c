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
 * Time O(bh R n (D + Dv)); memory O(bh splits R Dv) besides the inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32
#define MAX_ROWS 64
#define MAX_DIM 256

static void task(const float *q, const float *k, const float *v, long n, long j0, long j1, int R,
                 int nq, int D, int Dv, long k_row, long v_row, float scale, int causal, float *m,
                 float *l, float *acc) {
    float s[MAX_ROWS][TILE];
    int limit_off = (int)(n - nq); /* query i sees keys j <= limit_off + i */
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(acc + (long)r * Dv, 0, sizeof(float) * Dv);
    }
    for (long t0 = j0; t0 < j1; t0 += TILE) {
        int tn = (int)(j1 - t0 < TILE ? j1 - t0 : TILE);
        /* scores of the tile: s[r][t] = scale * q_r . k_t (masked: -inf) */
        for (int t = 0; t < tn; t++) {
            const float *kt = k + (t0 + t) * k_row;
            for (int r = 0; r < R; r++) {
                const float *qr = q + (long)r * D;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qr[d] * kt[d];
                s[r][t] = dot * scale;
            }
        }
        if (causal) {
            for (int r = 0; r < R; r++) {
                long last = limit_off + r % nq; /* the query's own position */
                for (int t = 0; t < tn; t++)
                    if (t0 + t > last) s[r][t] = -INFINITY;
            }
        }
        /* online softmax: rescale what the row has, add the tile */
        for (int r = 0; r < R; r++) {
            float mt = -INFINITY;
            for (int t = 0; t < tn; t++) mt = s[r][t] > mt ? s[r][t] : mt;
            if (mt == -INFINITY) continue; /* no key of this tile is visible to the row */
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
        /* acc_r += sum_t p[r][t] v_t, each value row read once per tile */
        for (int t = 0; t < tn; t++) {
            const float *vt = v + (t0 + t) * v_row;
            for (int r = 0; r < R; r++) {
                float p = s[r][t];
                if (m[r] == -INFINITY || p == 0.0f) continue;
                float *ar = acc + (long)r * Dv;
                for (int d = 0; d < Dv; d++) ar[d] += p * vt[d];
            }
        }
    }
}

/* Returns 0, or -1 if a size is outside what this kernel takes (the caller falls back). */
int decode_splitk(const float *q, const float *k, const float *v, float *out, long bh, int R, int nq,
                  long n, int D, int Dv, long k_pair, long k_row, long v_pair, long v_row, float scale,
                  int causal, int splits, int threads) {
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
        float mx = -INFINITY;
        for (int sidx = 0; sidx < splits; sidx++) {
            float mm = ms[(p * splits + sidx) * R + r];
            mx = mm > mx ? mm : mx;
        }
        float *o = out + pr * Dv;
        memset(o, 0, sizeof(float) * Dv);
        if (mx == -INFINITY) continue;
        float denom = 0.0f;
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
