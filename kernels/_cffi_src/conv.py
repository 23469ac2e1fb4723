"""Declarations for the convolution kernels: c/depthwise.c (depthwise convolutions, forward
and both gradients) and c/implicit_gemm.c (the others' forward and grad weight, unfolded by
c/unfold.c), on c/conv_geom.h's geometry and strides."""

INCLUDES = ""

TYPES = """
typedef struct mg_conv_geom {
    int64_t n, c, multiplier;
    int64_t h, w;
    int64_t oh, ow;
    int64_t kh, kw, sh, sw, dh, dw;
    int64_t top, left;
} mg_conv_geom;

typedef struct mg_strides4 {
    int64_t n, c, h, w;
} mg_strides4;
"""

FUNCTIONS = """
int mg_conv_forward(const mg_conv_geom *g, int64_t size, int64_t groups, int64_t oc,
                    const void *x, const mg_strides4 *xs, const void *w, void *y,
                    const mg_strides4 *ys, void *scratch, int64_t scratch_bytes, int64_t chunk);
int mg_conv_grad_weight(const mg_conv_geom *g, int64_t size, int64_t groups, int64_t oc,
                        const void *x, const mg_strides4 *xs, const void *dy,
                        const mg_strides4 *dys, void *dw, int64_t ldw, void *scratch,
                        int64_t scratch_bytes, int64_t chunk);
int mg_dw_forward_f32(const mg_conv_geom *g, const float *x, const float *w, float *y);
int mg_dw_forward_f64(const mg_conv_geom *g, const double *x, const double *w, double *y);
int mg_dw_grad_input_f32(const mg_conv_geom *g, const float *dy, const float *w, float *dx,
                         int64_t i0, int64_t rows, int64_t oh_lo, int64_t dy_rows);
int mg_dw_grad_input_f64(const mg_conv_geom *g, const double *dy, const double *w, double *dx,
                         int64_t i0, int64_t rows, int64_t oh_lo, int64_t dy_rows);
int mg_dw_grad_weight_f32(const mg_conv_geom *g, const float *x, const float *dy, float *dw);
int mg_dw_grad_weight_f64(const mg_conv_geom *g, const double *x, const double *dy, double *dw);
"""
