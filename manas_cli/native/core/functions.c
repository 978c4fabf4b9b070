/* The functions a layer applies element by element, each the core's own so that it vectorizes and gives the
   same bits everywhere: the exponential (softmax, GELU, SiLU), GELU and SiLU, LayerNorm and RMSNorm, and the
   rotary angles (computed in double by the core's own series, then rounded).

   Part of the core's one translation unit (core.c includes it after products.c). */

/* e^x to about 1 ulp without a call, so the loops over it (softmax, GELU) vectorize: x = k ln2 + r with
   |r| ≤ ln2/2 (ln2 split in two for an exact product), Cephes' polynomial for e^r, then 2^k in the exponent bits.
   Clamped to the range where 2^k is a normal float: e^EXP_FLOOR ≈ 1e-38 stands for 0. */
#define EXP_FLOOR -87.3f
#define EXP_CEILING 88.3f
static inline float exponential(float x) {
    x = x < EXP_FLOOR ? EXP_FLOOR : x > EXP_CEILING ? EXP_CEILING : x;
    float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (k == k ? (int32_t)k + 127 : 127) << 23;  /* a NaN x stays NaN (p is), never an integer */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* GPT-2's GELU, 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), with tanh(u) = 1 − 2 / (e^{2u} + 1): the error is
   absolute, about 1e-7, which is all 1 + tanh needs; or the exact GELU, 0.5 x (1 + erf(x / √2)). */
/* erf(x) for GELU's exact form, from the core's exponential: Numerical Recipes' erfc (a Chebyshev fit,
   fractional error below 1.2e-7 everywhere), erf = 1 − erfc, odd. Its absolute error (~1e-7) is what 1 + erf(x)
   needs; a libm's erff would differ from platform to platform in its last bits. */
static inline float own_erf(float x) {
    float z = fabsf(x), t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    float erfc = t * exponential(-z * z + p);
    return x < 0 ? erfc - 1.0f : 1.0f - erfc;
}

/* The rotary angles' functions in double, the core's own (their series in +, −, ×, ÷, each rounded as IEEE 754
   says on every CPU): e^x for |x| < 700 (x = k ln2 + r, ln2 in two parts, r's Taylor series to r^13, 2^k exact);
   ln x for x > 0 (x = m 2^e, ln m = 2 atanh((m − 1)/(m + 1)) by its series); cos and sin of an angle up to
   ~10^6 (π/2 in three parts, Cody and Waite, then Taylor series on |r| ≤ π/4). Each to about 1 ulp of double,
   far below the float32 the angles are stored in. */
static double own_exp(double x) {
    double k = nearbyint(x * 1.4426950408889634);
    double r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double term = 1.0, sum = 1.0;
    for (int i = 1; i <= 13; i++) term = term * r / i, sum += term;
    return ldexp(sum, (int)k);
}

static double own_log(double x) {
    if (!(x > 0) || x > DBL_MAX) return x == 0 ? -INFINITY : x > 0 ? x : NAN;  /* +inf stays; NaN and x < 0: NaN */
    int e;
    double m = frexp(x, &e);  /* m in [0.5, 1): exact */
    if (m < 0.70710678118654752) m *= 2.0, e -= 1;
    double s = (m - 1.0) / (m + 1.0), s2 = s * s, term = s, sum = 0.0;
    for (int k = 1; k <= 31; k += 2) sum += term / k, term *= s2;
    return 2.0 * sum + e * 6.93147180559945286227e-01;
}

static void own_sincos(double a, double *sine, double *cosine) {
    double k = nearbyint(a * 6.36619772367581382433e-01);  /* a / (π/2) */
    double r = ((a - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) - k * 2.02226624871116645580e-21;
    double r2 = r * r, s = r, c = 1.0, term_s = r, term_c = 1.0;
    for (int i = 1; i <= 10; i++) {
        term_s = -term_s * r2 / ((2 * i) * (2 * i + 1)), s += term_s;
        term_c = -term_c * r2 / ((2 * i - 1) * (2 * i)), c += term_c;
    }
    long quadrant = (long)fmod(k, 4.0);
    quadrant = quadrant < 0 ? quadrant + 4 : quadrant;
    *sine = quadrant == 0 ? s : quadrant == 1 ? c : quadrant == 2 ? -s : -c;
    *cosine = quadrant == 0 ? c : quadrant == 1 ? -s : quadrant == 2 ? -c : s;
}

/* e^(x[i] − top) for the count ≤ EXP_SPAN values x into out (which may be x), 0 below exponential's floor: a loop
   of fixed length, which vectorizes. */
#define EXP_SPAN 64
static void exp_span(int count, const float *x, float top, float *out) {
    float e[EXP_SPAN] = {0};
    memcpy(e, x, (size_t)count * sizeof *e);
    for (int j = 0; j < EXP_SPAN; j++) {
        float below = e[j] - top;
        e[j] = below < EXP_FLOOR ? 0.0f : exponential(below);
    }
    memcpy(out, e, (size_t)count * sizeof *e);
}

/* e^(x[i] − top) for i < n into out (out may be x; NULL: only summed) and their sum in double: softmax's numerator
   and denominator, and log-sum-exp's (top + log of the sum). top is the largest x. The exponentials are computed a
   span at a time; only the sum, in order, runs one value after another. */
static double exp_below(int n, const float *x, float top, float *out) {
    double total = 0;
    for (int i = 0; i < n; i += EXP_SPAN) {
        int count = n - i < EXP_SPAN ? n - i : EXP_SPAN;
        float e[EXP_SPAN], *span = out ? out + i : e;
        exp_span(count, x + i, top, span);
        for (int j = 0; j < count; j++) total += span[j];
    }
    return total;
}

static inline float gelu(float x, int tanh_approximation) {
    if (!tanh_approximation) return 0.5f * x * (1.0f + own_erf(x * 0.7071067811865476f));
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (2.0f - 2.0f / (exponential(2.0f * u) + 1.0f));
}

/* SiLU's x · sigmoid(x) = x / (1 + e^−x), over the core's exponential (clamped, so x far below zero gives a
   value within 1e-36 of 0, never a NaN). */
static inline float silu(float x) { return x / (1.0f + exponential(-x)); }

/* The MLP's activation in place over rows of its hidden features, split over the pool by rows: GELU, or with a
   gate (SwiGLU) silu(gate) · hidden. */
/* gate: a gated MLP's (SiLU's, or GELU's with gelu_gate), else NULL for GELU alone */
typedef struct { float *hidden; const float *gate; int width, tanh_approximation, gelu_gate; } Activate;

static void activate_rows(void *context, int begin, int end, int thread) {
    const Activate *a = context;
    (void)thread;
    size_t first = (size_t)begin * a->width, n = (size_t)(end - begin) * a->width;
    float *hidden = a->hidden + first;
    if (a->gate && a->gelu_gate) {
        const float *gate = a->gate + first;
        for (size_t i = 0; i < n; i++) hidden[i] = gelu(gate[i], a->tanh_approximation) * hidden[i];
    } else if (a->gate) {
        const float *gate = a->gate + first;
        for (size_t i = 0; i < n; i++) hidden[i] = silu(gate[i]) * hidden[i];
    } else if (a->tanh_approximation) {  /* two loops, so the tanh one vectorizes */
        for (size_t i = 0; i < n; i++) hidden[i] = gelu(hidden[i], 1);
    } else {
        for (size_t i = 0; i < n; i++) hidden[i] = gelu(hidden[i], 0);
    }
}

/* LayerNorm over C features: (x − mean) / sqrt(var + eps) · weight + bias, the variance the biased one. */
static void layernorm(int C, float eps, const ManasNorm *norm, const float *x, float *out) {
    float mean = sum(C, x) / (float)C;
    for (int i = 0; i < C; i++) out[i] = (x[i] - mean) * (x[i] - mean);
    float rstd = 1.0f / sqrtf(sum(C, out) / (float)C + eps);
    for (int i = 0; i < C; i++) out[i] = (x[i] - mean) * rstd * norm->weight[i];
    if (norm->bias)
        for (int i = 0; i < C; i++) out[i] += norm->bias[i];
}

/* RMSNorm over C features: x / sqrt(mean(x²) + eps) · weight (no mean taken out, no bias). */
static void rmsnorm(int C, float eps, const ManasNorm *norm, const float *x, float *out) {
    for (int i = 0; i < C; i++) out[i] = x[i] * x[i];
    float rstd = 1.0f / sqrtf(sum(C, out) / (float)C + eps);
    for (int i = 0; i < C; i++) out[i] = x[i] * rstd * norm->weight[i];
}

/* The model's norm of `rows` rows of C features, x into out. */
static void normalize(const ManasModel *m, const ManasNorm *norm, int rows, const float *x, float *out) {
    size_t C = (size_t)m->n_embd;
    for (size_t r = 0; r < (size_t)rows; r++)
        (m->rms_norm ? rmsnorm : layernorm)((int)C, m->norm_eps, norm, x + r * C, out + r * C);
}

/* The dimensions of a head that rope turns: its first rotary_dims (a partial rotary's), or all of them. */
static int rotary_dims(const ManasModel *m) { return m->rotary_dims ? m->rotary_dims : m->head_size; }

/* Each row's cos and sin of pos · base^(−2i/rotary) / factor_i (factor 1 without factors: the model's rope_factors,
   or NULL for a window layer's own rope), times rope_scale where set, computed in double and rounded to float, as
   torch_engine/rotary.py's rope_tables. */
static void rope_angles(const ManasModel *m, double base, const float *factors, int position, float *angles) {
    int half = rotary_dims(m) / 2;
    double scale = m->rope_scale != 0.0 ? m->rope_scale : 1.0;
    for (int i = 0; i < half; i++) {
        double frequency = own_exp(-(double)(2 * i) / (double)(2 * half) * own_log(base));
        if (factors) frequency /= (double)factors[i];
        double angle = (double)position * frequency;
        double sine, cosine;
        own_sincos(angle, &sine, &cosine);
        angles[i] = m->rope_scale != 0.0 ? (float)(cosine * scale) : (float)cosine;
        angles[half + i] = m->rope_scale != 0.0 ? (float)(sine * scale) : (float)sine;
    }
}

/* Rotate each pair (a, b) of one head's first `rotary` dimensions: (a cos − b sin, b cos + a sin). Pair i is
   (x[2i], x[2i+1]), manas' layout (and llama.cpp's `llama`), or with `halves` (x[i], x[i + rotary/2]), Hugging Face's
   rotate-half (llama.cpp's qwen2, whose GGUF files keep it). */
static void rotate(int rotary, int halves, const float *angles, float *x) {
    int half = rotary / 2;
    for (int i = 0; i < half; i++) {
        int first = halves ? i : 2 * i, second = halves ? i + half : 2 * i + 1;
        float a = x[first], b = x[second], c = angles[i], s = angles[half + i];
        x[first] = a * c + b * -s;
        x[second] = b * c + a * s;
    }
}
