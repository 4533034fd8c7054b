/* Block-sparse attention forward on the CPU: each query block against only its listed key blocks.
 *
 * Built on first use by variants/sparse_kernel.py with the system's C compiler (-O3 -march=native
 * -ffast-math -fopenmp) and called through ctypes on the tensors' memory; nothing here knows torch.
 *
 * Inputs (float32, contiguous): q (B, H, nq, D), k (B, Hkv, nk, D), v (B, Hkv, nk, Dv); out
 * (B, H, nq, Dv). Query i is position i + nk - nq of a layout of length nk cut into blocks of `blk`
 * tokens. The layout is a list of rows, one per query block: row x is query block qblock[x] and sees
 * key blocks cols[rowptr[x] .. rowptr[x + 1]) (no repeats). Causal: the query at position p sees
 * keys j <= p. window >= 0: the query at p sees only keys with |p - j| <= window, besides the first
 * `sinks` keys (StreamingLLM's sinks); window < 0: no band. kpm: (B, nk) bytes, 0 = a padded key, or
 * NULL. ds: packed documents, or NULL: (B, nk, 2) ints, the first and last position of the document
 * holding each position; the query at p sees only keys of its own document, first(p) <= j <= last(p)
 * (documents are contiguous runs, so this is one range per query, and per key the same range holds
 * the queries that see it). Query head h reads K/V head h / (H / Hkv). A row that sees no key comes out zero.
 *
 * Work: one task per (row, batch, head, chunk of up to ROWS queries), over all threads, rows in the
 * order given (the caller lists the heavy ones first). A task holds its queries transposed, scaled by
 * scale * log2(e), and walks its key blocks in tiles of KT keys with an online softmax in base 2:
 * scores S^T (keys x queries, the queries along the vector lanes, so the softmax's max and sum over
 * keys are lane-wise), then acc += P V. Keys and values are read in place, never gathered.
 * Time O(B H pairs (D + Dv)); memory O(threads ROWS (D + KT + Dv)) besides the inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* VL floats, loaded and stored at any alignment, in the target's widest vector registers: the
 * register tiles below are sized for them (a vector wider than the target's is split by the
 * compiler into pieces that no longer fit the registers: 20x slower) */
#if defined(__AVX512F__)
#define VB 64
#elif defined(__AVX__)
#define VB 32
#else
#define VB 16
#endif
typedef float vf __attribute__((vector_size(VB), aligned(4)));
typedef int vi __attribute__((vector_size(VB), aligned(4)));
#define VL (VB / 4)
#define ROWS 64 /* queries per task: RV vectors */
#define RV (ROWS / VL)
#define KT 64 /* keys per tile */
#define MAX_DIM 256
#define MAX_KEYS (1 << 24) /* positions are compared as floats, exact up to 2^24 */
/* register tiles: scores take KS keys x RG query vectors at a time, the weighted sum WR query rows x
 * 4 value vectors; KS * RG and 4 * WR accumulators fit beside their operands in the 16 registers of
 * AVX2 and the 32 of AVX-512 or NEON */
#define RG 4
#define KS (VB == 32 ? 2 : 4)
#define WR (VB == 32 ? 2 : 4)
#define LOG2E 1.4426950408889634f

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf select_v(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf max_v(vf a, vf b) { return select_v(a > b, a, b); }

/* 2^x per lane, exactly 0 where x < -126 (x = -inf included): x = n + f, |f| <= 1/2, 2^f by its
 * Taylor series to f^7 (relative error below 2e-7), 2^n put in the exponent bits */
static inline vf exp2_v(vf x) {
    vi dead = x < -126.0f;
    x = max_v(x, splat(-126.0f));
    vf y = x + 0.5f;
    vi n = __builtin_convertvector(y, vi);            /* truncated toward zero */
    n += (vi)(__builtin_convertvector(n, vf) > y);    /* floor: -1 where truncation rounded up */
    vf f = (x - __builtin_convertvector(n, vf)) * 0.6931471805599453f; /* f ln 2 */
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720 + f * (1.0f / 5040)))))));
    vf r = (vf)((vi)p + (n << 23));
    return (vf)((vi)r & ~dead);
}

/* s[t][x0 ..] = k_t . qt over rg vectors of queries from vector x0, for the tile's nt keys (rows of
 * k, stride D): KS keys at a time, KS * rg accumulators in registers */
static inline __attribute__((always_inline)) void scores_group(const float *k, int nt, int D, const float *qt,
                                                               float s[KT][ROWS], int x0, const int rg) {
    int t = 0;
    for (; t + KS <= nt; t += KS) {
        vf a[KS][RG];
        for (int i = 0; i < KS; i++)
            for (int x = 0; x < rg; x++) a[i][x] = splat(0.0f);
        const float *k0 = k + (long)t * D;
        for (int d = 0; d < D; d++) {
            const float *qd = qt + d * ROWS + x0 * VL;
            for (int x = 0; x < rg; x++) {
                vf qv = *(const vf *)(qd + x * VL);
                for (int i = 0; i < KS; i++) a[i][x] += k0[i * D + d] * qv;
            }
        }
        for (int i = 0; i < KS; i++)
            for (int x = 0; x < rg; x++) *(vf *)(s[t + i] + (x0 + x) * VL) = a[i][x];
    }
    for (; t < nt; t++) {
        vf a[RG];
        for (int x = 0; x < rg; x++) a[x] = splat(0.0f);
        const float *kr = k + (long)t * D;
        for (int d = 0; d < D; d++)
            for (int x = 0; x < rg; x++) a[x] += kr[d] * *(const vf *)(qt + d * ROWS + (x0 + x) * VL);
        for (int x = 0; x < rg; x++) *(vf *)(s[t] + (x0 + x) * VL) = a[x];
    }
}

/* s[t][.] = k_t . qt for the first rv query vectors, in groups of RG */
static void scores(const float *k, int nt, int D, const float *qt, float s[KT][ROWS], int rv) {
    for (int x0 = 0; x0 < rv; x0 += RG) {
        switch (rv - x0) {
        case 1: scores_group(k, nt, D, qt, s, x0, 1); break;
        case 2: scores_group(k, nt, D, qt, s, x0, 2); break;
        case 3: scores_group(k, nt, D, qt, s, x0, 3); break;
        default: scores_group(k, nt, D, qt, s, x0, 4); break;
        }
    }
}

/* acc[r][:] += sum_t p[t][r] v_t for rows r < nr: WR rows by four value vectors in registers over
 * the tile's keys; the tile's value rows are re-read from L1 */
static void weighted_sum(const float *v, int nt, int Dv, float p[KT][ROWS], int nr, float *acc) {
    for (int r = 0; r < nr; r += WR) {
        int rn = nr - r < WR ? nr - r : WR;
        int d = 0;
        for (; d + 4 * VL <= Dv; d += 4 * VL) {
            vf a[WR][4];
            for (int i = 0; i < WR; i++)
                for (int c = 0; c < 4; c++) a[i][c] = *(vf *)(acc + (long)(r + (i < rn ? i : 0)) * Dv + d + c * VL);
            for (int t = 0; t < nt; t++) {
                const float *vt = v + (long)t * Dv + d;
                vf v0 = *(const vf *)vt, v1 = *(const vf *)(vt + VL), v2 = *(const vf *)(vt + 2 * VL),
                   v3 = *(const vf *)(vt + 3 * VL);
                for (int i = 0; i < WR; i++) {
                    float w = p[t][r + i]; /* rows past nr are computed and not stored */
                    a[i][0] += w * v0;
                    a[i][1] += w * v1;
                    a[i][2] += w * v2;
                    a[i][3] += w * v3;
                }
            }
            for (int i = 0; i < rn; i++)
                for (int c = 0; c < 4; c++) *(vf *)(acc + (long)(r + i) * Dv + d + c * VL) = a[i][c];
        }
        for (; d + VL <= Dv; d += VL)
            for (int i = 0; i < rn; i++) {
                vf a = *(vf *)(acc + (long)(r + i) * Dv + d);
                for (int t = 0; t < nt; t++) a += p[t][r + i] * *(const vf *)(v + (long)t * Dv + d);
                *(vf *)(acc + (long)(r + i) * Dv + d) = a;
            }
        for (; d < Dv; d++)
            for (int i = 0; i < rn; i++) {
                float a = acc[(long)(r + i) * Dv + d];
                for (int t = 0; t < nt; t++) a += p[t][r + i] * v[(long)t * Dv + d];
                acc[(long)(r + i) * Dv + d] = a;
            }
    }
}

/* -inf where a key is hidden from a query: a padded key; a key after the query's position (causal);
 * a key outside the query's band unless it is a sink (window >= 0); a key of another document (ds).
 * Scores held keys x queries: row t is key j0 + t, lane i of vector x the query at pos[x][i]. */
static void mask_key_rows(float s[KT][ROWS], int nt, int rv, long j0, const vf *pos, long p0,
                          const unsigned char *kpm, const int *ds, int causal, long window, long sinks) {
    for (int t = 0; t < nt; t++) {
        long j = j0 + t;
        int band = window >= 0 && j >= sinks;
        if (kpm && !kpm[j]) {
            for (int x = 0; x < rv; x++) *(vf *)(s[t] + x * VL) = splat(-INFINITY);
        } else if (band || ds || (causal && j > p0)) {
            float fj = (float)j, lo = (float)(j - window), hi = (float)(j + window);
            /* the queries that see key j are those of its document: positions ds[2j] .. ds[2j + 1] */
            float dlo = ds ? (float)ds[2 * j] : 0.0f, dhi = ds ? (float)ds[2 * j + 1] : 0.0f;
            for (int x = 0; x < rv; x++) {
                vi out = {0};
                if (causal) out |= pos[x] < fj;
                if (band) out |= (pos[x] < lo) | (pos[x] > hi);
                if (ds) out |= (pos[x] < dlo) | (pos[x] > dhi);
                *(vf *)(s[t] + x * VL) = select_v(out, splat(-INFINITY), *(vf *)(s[t] + x * VL));
            }
        }
    }
}

/* The same rule with the roles swapped: row t is the query at position p0 + t, lane i of vector x
 * the key at kpos[x][i]; hidden[x] marks the padded keys and the lanes past the tile. */
static void mask_query_rows(float s[KT][ROWS], int nt, int rv, long p0, const vf *kpos, const vi *hidden,
                            const int *ds, int causal, long window, long sinks) {
    for (int t = 0; t < nt; t++) {
        float p = (float)(p0 + t), lo = (float)(p0 + t - window), hi = (float)(p0 + t + window);
        /* the keys the query at p sees are those of its document: positions ds[2p] .. ds[2p + 1] */
        float dlo = ds ? (float)ds[2 * (p0 + t)] : 0.0f, dhi = ds ? (float)ds[2 * (p0 + t) + 1] : 0.0f;
        for (int x = 0; x < rv; x++) {
            vi out = hidden[x];
            if (causal) out |= kpos[x] > p;
            if (window >= 0) out |= ((kpos[x] < lo) | (kpos[x] > hi)) & (kpos[x] >= (float)sinks);
            if (ds) out |= (kpos[x] < dlo) | (kpos[x] > dhi);
            *(vf *)(s[t] + x * VL) = select_v(out, splat(-INFINITY), *(vf *)(s[t] + x * VL));
        }
    }
}

typedef struct {
    float qt[MAX_DIM * ROWS];      /* the task's queries, transposed (D x ROWS), scaled */
    float s[KT][ROWS];             /* scores, then probabilities, of one tile (keys x queries) */
    float acc[ROWS * MAX_DIM];     /* running weighted sums (ROWS x Dv) */
    float m[ROWS], l[ROWS];        /* running max (base 2) and sum per query */
} scratch;

/* one task: queries q0 .. q0+nr-1 (positions p0 ..) of one (batch, head) against key blocks cols */
static void task(const float *q, const float *k, const float *v, float *out, float *lse,
                 const unsigned char *kpm, const int *ds, const int *cols, int ncols, int nr, long p0, int nk,
                 int D, int Dv, int blk, float scale2, int causal, long window, long sinks, scratch *w) {
    const int rv = (nr + VL - 1) / VL;
    for (int d = 0; d < D; d++)
        for (int r = 0; r < ROWS; r++) w->qt[d * ROWS + r] = r < nr ? q[(long)r * D + d] * scale2 : 0.0f;
    for (int r = 0; r < ROWS; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * ROWS * Dv);
    vf pos[RV]; /* each query's position, for the causal test */
    for (int x = 0; x < RV; x++)
        for (int i = 0; i < VL; i++) pos[x][i] = (float)(p0 + x * VL + i);
    long last = p0 + nr - 1;
    for (int c = 0; c < ncols; c++) {
        long k0 = (long)cols[c] * blk, k1 = k0 + blk < nk ? k0 + blk : nk;
        if (causal && k1 - 1 > last) k1 = last + 1; /* keys after the last query are never seen */
        for (long j0 = k0; j0 < k1; j0 += KT) {
            int nt = (int)(k1 - j0 < KT ? k1 - j0 : KT);
            scores(k + j0 * D, nt, D, w->qt, w->s, rv);
            mask_key_rows(w->s, nt, rv, j0, pos, p0, kpm, ds, causal, window, sinks);
            /* online softmax, lane-wise over the queries */
            for (int x = 0; x < rv; x++) {
                vf mt = splat(-INFINITY);
                for (int t = 0; t < nt; t++) mt = max_v(mt, *(vf *)(w->s[t] + x * VL));
                vf mo = *(vf *)(w->m + x * VL);
                vf mn = max_v(mo, mt);
                vf base = select_v(mn == -INFINITY, splat(0.0f), mn); /* a query that has seen nothing */
                vf corr = exp2_v(mo - base);                           /* 0 while m = -inf */
                vf sum = splat(0.0f);
                for (int t = 0; t < nt; t++) {
                    vf pt = exp2_v(*(vf *)(w->s[t] + x * VL) - base);
                    *(vf *)(w->s[t] + x * VL) = pt;
                    sum += pt;
                }
                *(vf *)(w->l + x * VL) = *(vf *)(w->l + x * VL) * corr + sum;
                *(vf *)(w->m + x * VL) = mn;
                for (int i = 0; i < VL && x * VL + i < nr; i++) {
                    float ci = corr[i];
                    if (ci != 1.0f) {
                        float *a = w->acc + (long)(x * VL + i) * Dv;
                        for (int d = 0; d < Dv; d++) a[d] *= ci;
                    }
                }
            }
            weighted_sum(v + j0 * Dv, nt, Dv, w->s, nr, w->acc);
        }
    }
    for (int r = 0; r < nr; r++) {
        float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        for (int d = 0; d < Dv; d++) out[(long)r * Dv + d] = w->acc[(long)r * Dv + d] * inv;
        /* the row's log-sum-exp in base 2 for the backward; +inf for a row that saw nothing, so
         * that its probabilities there come out 0 */
        if (lse) lse[r] = w->l[r] > 0.0f ? w->m[r] + log2f(w->l[r]) : INFINITY;
    }
}

/* Query task x of the layout: row (of the layout), batch b, head h and chunk of up to ROWS queries;
 * its first position p0, its queries nr, its first query row r0 in (B, H, nq) and its K/V head's
 * first row kv in (B, Hkv, nk). Returns 0 where the chunk holds no query. */
typedef struct {
    long row, p0, r0, kv;
    int nr, b;
} qtask;

static int query_task(long x, const int *qblock, int B, int H, int Hkv, int chunks, int blk, int nq, int nk,
                      qtask *t) {
    const long off = nk - nq;
    t->row = x / ((long)B * H * chunks);
    long rest = x % ((long)B * H * chunks);
    t->b = (int)(rest / (H * chunks));
    int h = (int)(rest / chunks % H), ch = (int)(rest % chunks);
    long s = (long)qblock[t->row] * blk, e = s + blk < nk ? s + blk : nk;
    s = s > off ? s : off; /* positions before the first query are not queries */
    t->p0 = s + (long)ch * ROWS;
    if (t->p0 >= e) return 0;
    t->nr = (int)(e - t->p0 < ROWS ? e - t->p0 : ROWS);
    t->r0 = ((long)t->b * H + h) * nq + (t->p0 - off);
    t->kv = ((long)t->b * Hkv + h / (H / Hkv)) * nk;
    return 1;
}

/* Returns 0, or -1 if a size is outside what this kernel takes (the caller falls back). */
int sparse_fwd(const float *q, const float *k, const float *v, float *out, float *lse, const unsigned char *kpm,
               const int *ds, const int *qblock, const int *rowptr, const int *cols, int nrows, int B, int H, int Hkv,
               int nq, int nk, int D, int Dv, int blk, float scale, int causal, int window, int sinks,
               int threads) {
    if (D > MAX_DIM || Dv > MAX_DIM || D < 1 || Dv < 1 || blk < 1 || nq > nk || Hkv < 1 || H % Hkv ||
        nk > MAX_KEYS)
        return -1;
    const int chunks = (blk + ROWS - 1) / ROWS;
    const long tasks = (long)nrows * B * H * chunks;
    const float scale2 = scale * LOG2E;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        scratch *w = aligned_alloc(64, sizeof(scratch));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long x = 0; x < tasks; x++) {
            qtask t;
            if (!w || !query_task(x, qblock, B, H, Hkv, chunks, blk, nq, nk, &t)) continue;
            task(q + t.r0 * D, k + t.kv * D, v + t.kv * Dv, out + t.r0 * Dv, lse ? lse + t.r0 : NULL,
                 kpm ? kpm + (long)t.b * nk : NULL, ds ? ds + 2L * t.b * nk : NULL, cols + rowptr[t.row], rowptr[t.row + 1] - rowptr[t.row], t.nr,
                 t.p0, nk, D, Dv, blk, scale2, causal, window, sinks, w);
        }
        free(w);
    }
    return failed ? -1 : 0;
}

/* ---- backward (FlashAttention-2's recomputation: P from the saved log-sum-exp, no N x N buffer) ----
 * With S = scale q.k, P = softmax(S) over the visible keys, O = P V and Di = dO_i . O_i:
 *   dV_j = sum_i P_ij dO_i,  dS_ij = P_ij (dO_i . V_j - Di),  dQ_i = scale sum_j dS_ij K_j,
 *   dK_j = scale sum_i dS_ij Q_i.
 * Pass 1 computes dQ per query task (as the forward: keys x queries, queries along the lanes); pass 2
 * computes dK and dV per task of up to ROWS keys of one K/V head (queries x keys, keys along the
 * lanes), over the query blocks that see its key block and every query head of the group. Each
 * output row is written by one task, so no atomics. */

typedef struct {
    float at[MAX_DIM * ROWS]; /* pass 1: the queries (D x ROWS), scaled; pass 2: the keys, scaled */
    float bt[MAX_DIM * ROWS]; /* pass 1: dO (Dv x ROWS); pass 2: the values */
    float s[KT][ROWS], s2[KT][ROWS];
    float acc1[ROWS * MAX_DIM], acc2[ROWS * MAX_DIM];
} scratch_bwd;

/* xt[d][r] = scale * x[r][d] for the first n rows of x (n x dim, row-major), zero past them */
static void transpose_in(const float *x, int n, int dim, float scale, float *xt) {
    for (int d = 0; d < dim; d++)
        for (int r = 0; r < ROWS; r++) xt[d * ROWS + r] = r < n ? x[(long)r * dim + d] * scale : 0.0f;
}

static void task_dq(const float *q, const float *k, const float *v, const float *dout, const float *lse,
                    const float *di, float *dq, const unsigned char *kpm, const int *ds, const int *cols,
                    int ncols, int nr,
                    long p0, int nk, int D, int Dv, int blk, float scale, float scale2, int causal,
                    long window, long sinks, scratch_bwd *w) {
    const int rv = (nr + VL - 1) / VL;
    transpose_in(q, nr, D, scale2, w->at);
    transpose_in(dout, nr, Dv, 1.0f, w->bt);
    vf pos[RV], lv[RV], dv_[RV];
    for (int x = 0; x < RV; x++)
        for (int i = 0; i < VL; i++) {
            int r = x * VL + i;
            pos[x][i] = (float)(p0 + r);
            lv[x][i] = r < nr ? lse[r] : INFINITY;
            dv_[x][i] = r < nr ? di[r] : 0.0f;
        }
    memset(w->acc1, 0, sizeof(float) * ROWS * D);
    long last = p0 + nr - 1;
    for (int c = 0; c < ncols; c++) {
        long k0 = (long)cols[c] * blk, k1 = k0 + blk < nk ? k0 + blk : nk;
        if (causal && k1 - 1 > last) k1 = last + 1;
        for (long j0 = k0; j0 < k1; j0 += KT) {
            int nt = (int)(k1 - j0 < KT ? k1 - j0 : KT);
            scores(k + j0 * D, nt, D, w->at, w->s, rv);
            mask_key_rows(w->s, nt, rv, j0, pos, p0, kpm, ds, causal, window, sinks);
            scores(v + j0 * Dv, nt, Dv, w->bt, w->s2, rv); /* dP = dO . V */
            for (int t = 0; t < nt; t++)
                for (int x = 0; x < rv; x++) {
                    vf p = exp2_v(*(vf *)(w->s[t] + x * VL) - lv[x]);
                    *(vf *)(w->s[t] + x * VL) = p * (*(vf *)(w->s2[t] + x * VL) - dv_[x]); /* dS */
                }
            weighted_sum(k + j0 * D, nt, D, w->s, nr, w->acc1);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int d = 0; d < D; d++) dq[(long)r * D + d] = w->acc1[(long)r * D + d] * scale;
}

/* keys kc0 .. kc0+nkc-1 of one K/V head (k, v at the head's first row; dk, dv likewise) against the
 * query blocks qrows[0 .. nqrows) of each of its grp query heads (q, dout, lse, di at the group's
 * first head; a head is nq rows further) */
static void task_dkv(const float *q, const float *k, const float *v, const float *dout, const float *lse,
                     const float *di, float *dk, float *dv, const unsigned char *kpm, const int *ds,
                     const int *qrows,
                     int nqrows, long kc0, int nkc, int nq, int nk, int grp, int D, int Dv, int blk,
                     float scale, float scale2, int causal, long window, long sinks, scratch_bwd *w) {
    const int rv = (nkc + VL - 1) / VL;
    const long off = nk - nq;
    transpose_in(k + kc0 * D, nkc, D, scale2, w->at);
    transpose_in(v + kc0 * Dv, nkc, Dv, 1.0f, w->bt);
    vf kpos[RV];
    vi hidden[RV];
    for (int x = 0; x < RV; x++)
        for (int i = 0; i < VL; i++) {
            int r = x * VL + i;
            kpos[x][i] = (float)(kc0 + r);
            hidden[x][i] = (r >= nkc || (kpm && !kpm[kc0 + r])) ? -1 : 0;
        }
    memset(w->acc1, 0, sizeof(float) * ROWS * D);
    memset(w->acc2, 0, sizeof(float) * ROWS * Dv);
    for (int c = 0; c < nqrows; c++) {
        long s = (long)qrows[c] * blk, e = s + blk < nk ? s + blk : nk;
        s = s > off ? s : off;
        if (causal && e - 1 < kc0) continue; /* every query before every key */
        for (int g = 0; g < grp; g++) {
            long head = (long)g * nq; /* rows of this query head, from the group's first */
            for (long t0 = s; t0 < e; t0 += KT) {
                int nt = (int)(e - t0 < KT ? e - t0 : KT);
                if (causal && t0 + nt - 1 < kc0) continue;
                long row = head + t0 - off;
                const float *qr = q + row * D, *dor = dout + row * Dv, *lr = lse + row, *dr = di + row;
                scores(qr, nt, D, w->at, w->s, rv);
                mask_query_rows(w->s, nt, rv, t0, kpos, hidden, ds, causal, window, sinks);
                for (int t = 0; t < nt; t++)
                    for (int x = 0; x < rv; x++) *(vf *)(w->s[t] + x * VL) = exp2_v(*(vf *)(w->s[t] + x * VL) - lr[t]);
                scores(dor, nt, Dv, w->bt, w->s2, rv);        /* dP = dO . V */
                weighted_sum(dor, nt, Dv, w->s, nkc, w->acc2); /* dV += P^T dO */
                for (int t = 0; t < nt; t++)
                    for (int x = 0; x < rv; x++)
                        *(vf *)(w->s2[t] + x * VL) = *(vf *)(w->s[t] + x * VL) * (*(vf *)(w->s2[t] + x * VL) - dr[t]);
                weighted_sum(qr, nt, D, w->s2, nkc, w->acc1); /* dK += dS^T Q (scaled below) */
            }
        }
    }
    for (int r = 0; r < nkc; r++) {
        for (int d = 0; d < D; d++) dk[(kc0 + r) * D + d] = w->acc1[(long)r * D + d] * scale;
        for (int d = 0; d < Dv; d++) dv[(kc0 + r) * Dv + d] = w->acc2[(long)r * Dv + d];
    }
}

/* Gradients of sparse_fwd's output: dq (B, H, nq, D), dk, dv (B, Hkv, nk, D|Dv), all written (keys no
 * query sees get zeros). lse: sparse_fwd's (B, H, nq); di: (B, H, nq) = rowsum(dout * out). The
 * layout as sparse_fwd's, plus its transpose: key block c is seen by query blocks
 * qrows[kptr[c] .. kptr[c + 1]), for the nkb = ceil(nk / blk) key blocks. Returns 0, or -1. */
int sparse_bwd(const float *q, const float *k, const float *v, const float *dout, const float *lse,
               const float *di, float *dq, float *dk, float *dv, const unsigned char *kpm, const int *ds,
               const int *qblock,
               const int *rowptr, const int *cols, int nrows, const int *kptr, const int *qrows, int nkb,
               int B, int H, int Hkv, int nq, int nk, int D, int Dv, int blk, float scale, int causal,
               int window, int sinks, int threads) {
    if (D > MAX_DIM || Dv > MAX_DIM || D < 1 || Dv < 1 || blk < 1 || nq > nk || Hkv < 1 || H % Hkv ||
        nk > MAX_KEYS)
        return -1;
    const int chunks = (blk + ROWS - 1) / ROWS;
    const long tasks1 = (long)nrows * B * H * chunks, tasks2 = (long)nkb * B * Hkv * chunks;
    const int grp = H / Hkv;
    const float scale2 = scale * LOG2E;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        scratch_bwd *w = aligned_alloc(64, sizeof(scratch_bwd));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long x = 0; x < tasks1; x++) {
            qtask t;
            if (!w || !query_task(x, qblock, B, H, Hkv, chunks, blk, nq, nk, &t)) continue;
            task_dq(q + t.r0 * D, k + t.kv * D, v + t.kv * Dv, dout + t.r0 * Dv, lse + t.r0, di + t.r0,
                    dq + t.r0 * D, kpm ? kpm + (long)t.b * nk : NULL, ds ? ds + 2L * t.b * nk : NULL,
                    cols + rowptr[t.row],
                    rowptr[t.row + 1] - rowptr[t.row], t.nr, t.p0, nk, D, Dv, blk, scale, scale2, causal, window,
                    sinks, w);
        }
#pragma omp for schedule(dynamic, 1)
        for (long x = 0; x < tasks2; x++) {
            if (!w) continue;
            long col = x / ((long)B * Hkv * chunks), rest = x % ((long)B * Hkv * chunks);
            int b = (int)(rest / (Hkv * chunks)), hk = (int)(rest / chunks % Hkv), ch = (int)(rest % chunks);
            long kc0 = col * blk + (long)ch * ROWS, ke = col * blk + blk < nk ? col * blk + blk : nk;
            if (kc0 >= ke) continue;
            int nkc = (int)(ke - kc0 < ROWS ? ke - kc0 : ROWS);
            long kv = ((long)b * Hkv + hk) * nk;
            long r0 = ((long)b * H + (long)hk * grp) * nq; /* the group's first query head */
            task_dkv(q + r0 * D, k + kv * D, v + kv * Dv, dout + r0 * Dv, lse + r0, di + r0, dk + kv * D,
                     dv + kv * Dv, kpm ? kpm + (long)b * nk : NULL, ds ? ds + 2L * b * nk : NULL, qrows + kptr[col], kptr[col + 1] - kptr[col],
                     kc0, nkc, nq, nk, grp, D, Dv, blk, scale, scale2, causal, window, sinks, w);
        }
        free(w);
    }
    return failed ? -1 : 0;
}
