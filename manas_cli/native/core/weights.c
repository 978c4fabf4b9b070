/* Loading: the checkpoint's tensors as the core reads them. Python maps the file and checks every extent; the core
   converts half-precision values, finds a value that is not finite, checks quantized rows, and regroups each
   layer's weights into the panels the products stream (manas_pack).

   Part of the core's one translation unit (core.c includes it after the forward pass). */

enum { STORED_F32 = 0, STORED_F16 = 1, STORED_BF16 = 2, STORED_F64 = 3 };

/* Element i of a stored float tensor (little-endian, maybe unaligned: memcpy) as float32, rounded to nearest. */
static float stored_float(const unsigned char *src, int dtype, int64_t i) {
    if (dtype == STORED_F64) {
        double d;
        memcpy(&d, src + 8 * i, 8);
        return (float)d;
    }
    if (dtype == STORED_F32) {
        float f;
        memcpy(&f, src + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, src + 2 * i, 2);
    return dtype == STORED_F16 ? f16_to_float(h) : bf16_to_float(h);
}

/* float32 to bfloat16 as torch rounds it: to nearest, ties to even; a NaN stays a (quiet) NaN. */
static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* n stored floats to float32 (out_bf16 0) or bfloat16 (1) in dst; the index of the first value that is not finite
   there (a float64 1e300 becomes infinite as float32), or −1. */
EXPORT int64_t manas_convert(const void *src, int dtype, int64_t n, int out_bf16, void *dst) {
    int64_t bad = -1;
    for (int64_t i = 0; i < n; i++) {
        float f = stored_float(src, dtype, i);
        if (out_bf16) {
            uint16_t h = float_to_bf16(f);
            ((uint16_t *)dst)[i] = h;
            f = bf16_to_float(h);
        } else {
            ((float *)dst)[i] = f;
        }
        if (bad < 0 && !isfinite(f)) bad = i;
    }
    return bad;
}

/* The index of the first value of a float32 tensor that is not finite, or −1. A float is NaN or infinite when
   its exponent bits are all ones: blocks of values are tested for that without a branch (so the loop vectorizes
   and a whole model's check costs about a read of it), and only a block that has one is searched. */
EXPORT int64_t manas_first_not_finite(const void *src, int64_t n) {
    const unsigned char *bytes = src;
    for (int64_t begin = 0; begin < n; begin += 4096) {
        int64_t end = begin + 4096 < n ? begin + 4096 : n;
        uint32_t found = 0;
        for (int64_t i = begin; i < end; i++) {
            uint32_t bits;
            memcpy(&bits, bytes + 4 * i, sizeof bits);
            found |= (bits & 0x7F800000u) == 0x7F800000u;
        }
        for (int64_t i = begin; found && i < end; i++)
            if (!isfinite(stored_float(src, STORED_F32, i))) return i;
    }
    return -1;
}

/* Which stored tensor of a quantized layer makes a dequantized weight infinite in float32 (torch_engine/quantize.py's
   overflowing_tensor): 1 its scales (int8: a row's scale × 127; int4: a group's scale × 8, the codes' reach),
   2 its zeros (int4: the zero plus that reach), 0 neither. */
EXPORT int manas_quantized_overflow(const ManasLinear *linear) {
    size_t groups = linear->kind == WEIGHTS_INT8 ? (size_t)linear->n_out
                                                 : (size_t)linear->n_out * (linear->n_in / linear->group);
    float reach = linear->kind == WEIGHTS_INT8 ? 127.0f : (float)INT4_MIDDLE;
    int overflow = 0;
    for (size_t g = 0; g < groups && overflow < 1; g++)
        if (!isfinite(fabsf(bf16_to_float(linear->scales[g])) * reach)) overflow = 1;
    for (size_t g = 0; linear->kind == WEIGHTS_INT4 && g < groups && !overflow; g++) {
        float spread = fabsf(bf16_to_float(linear->scales[g])) * reach;
        if (!isfinite(spread + fabsf(bf16_to_float(linear->zeros[g])))) overflow = 2;
    }
    return overflow;
}

/* Whether every dequantized row of a quantized layer is finite (the token embedding a quantized file implies). */
EXPORT int manas_dequantized_finite(const ManasLinear *linear, float *row) {
    for (int o = 0; o < linear->n_out; o++) {
        dequantize_row(linear, o, row);
        for (int i = 0; i < linear->n_in; i++)
            if (!isfinite(row[i])) return 0;
    }
    return 1;
}

/* The bytes of a layer's panels (see PANEL_UNIT), or 0 where it keeps its rows as stored: rows that are not whole
   units (a row's last unit would mix it with the next) but int4 rows of whole groups (their last unit padded, see
   panel_row_bytes), or no layer. */
EXPORT size_t manas_panel_bytes(const ManasLinear *linear) {
    if (linear->kind == WEIGHTS_GGML) return 0;  /* read in place, from the file's mapping */
    size_t bytes = row_bytes(linear);
    int padded = linear->kind == WEIGHTS_INT4 && int4_integer(linear);
    if (!linear->weight || bytes == 0 || (bytes % PANEL_UNIT && !padded)) return 0;
    size_t tiles = ((size_t)linear->n_out + TILE - 1) / TILE;
    return panel_weight_bytes(linear) + tiles * tile_group_scale_count(linear) * sizeof(uint16_t);
}

/* Writes the layer's panels to out, manas_panel_bytes of it: each row's units to their places (zeros in the last
   panel's rows past n_out, and past the end of a row that ends part-way through a unit), then an int4 integer
   product's scales and zeros, tile by tile. */
EXPORT void manas_pack(const ManasLinear *linear, void *out) {
    size_t bytes = row_bytes(linear), units = panel_row_bytes(linear) / PANEL_UNIT, rows = (size_t)linear->n_out;
    size_t tiles = (rows + TILE - 1) / TILE;
    for (size_t o = 0; o < tiles * TILE; o++) {
        uint8_t *panel = (uint8_t *)out + o / TILE * TILE * panel_row_bytes(linear) + o % TILE * PANEL_UNIT;
        for (size_t u = 0; u < units; u++) {
            uint8_t *to = panel + u * TILE * PANEL_UNIT;
            size_t held = o < rows && u * PANEL_UNIT < bytes ? bytes - u * PANEL_UNIT : 0;  /* the row's, in unit u */
            held = held < PANEL_UNIT ? held : PANEL_UNIT;
            if (held) memcpy(to, (const uint8_t *)linear->weight + o * bytes + u * PANEL_UNIT, held);
            memset(to + held, 0, PANEL_UNIT - held);
        }
    }
    uint16_t *scales = (uint16_t *)((uint8_t *)out + panel_weight_bytes(linear));
    for (size_t t = 0; tile_group_scale_count(linear) && t < tiles; t++) {
        int o0 = (int)(t * TILE), count = (int)(rows - t * TILE < TILE ? rows - t * TILE : TILE);
        int4_groups(linear, o0, count, scales + t * tile_group_scale_count(linear));
    }
}

/* Row o of a GGUF file's layer as float32, the values its products multiply (core/blocks.c): for the tests'
   reference and for a token embedding's rows. */
EXPORT void manas_ggml_row(const ManasLinear *linear, int o, float *out) { ggml_dequantize_row(linear, o, out); }

/* The products of a GGUF file's layer with `rows` rows of x (rows, n_in) into y (rows, n_out), one thread, as the
   forward pass computes them: x quantized per unit (integer 1) into `quantized` (rows, quantized_floats(n_in)), or
   multiplied as float32 over each weight row dequantized into `row` (n_in floats). For the tests' reference. */
EXPORT void manas_ggml_products(const ManasLinear *linear, int rows, const float *x, int integer, float *quantized,
                                float *row, float *y) {
    int n = linear->n_in, in_integers = ggml_quantized(linear, integer);
    for (int r = 0; in_integers && r < rows; r++)
        quantize_blocks(linear, x + (size_t)r * n, quantized + (size_t)r * quantized_floats(n));
    size_t stride = in_integers ? quantized_floats(n) : (size_t)n;
    Matmul m = {linear, WEIGHTS_GGML, in_integers ? quantized : x, stride, y, (size_t)linear->n_out, rows, NULL,
                in_integers};
    ggml_tiles(&m, 0, (linear->n_out + TILE - 1) / TILE, row);
}

/* The floats an activation row of n values takes quantized (manas_ggml_products' `quantized`, per row). */
EXPORT size_t manas_quantized_row_floats(int n) { return quantized_floats(n); }
