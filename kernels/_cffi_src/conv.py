"""Declarations for the convolution kernels: c/depthwise.c (depthwise convolutions, forward
and both gradients) and c/unfold.c (the implicit GEMM's unfold), on c/conv_geom.h's geometry."""

INCLUDES = ""

TYPES = """
typedef struct mg_conv_geom {
    int64_t n, c, multiplier;
    int64_t h, w;
    int64_t oh, ow;
    int64_t kh, kw, sh, sw, dh, dw;
    int64_t top, left;
} mg_conv_geom;
"""

FUNCTIONS = """
int mg_unfold_f32(const mg_conv_geom *g, const float *x, float *cols);
int mg_unfold_f64(const mg_conv_geom *g, const double *x, double *cols);
int mg_dw_forward_f32(const mg_conv_geom *g, const float *x, const float *w, float *y);
int mg_dw_forward_f64(const mg_conv_geom *g, const double *x, const double *w, double *y);
int mg_dw_grad_input_f32(const mg_conv_geom *g, const float *dy, const float *w, float *dx,
                         int64_t i0, int64_t rows, int64_t oh_lo, int64_t dy_rows);
int mg_dw_grad_input_f64(const mg_conv_geom *g, const double *dy, const double *w, double *dx,
                         int64_t i0, int64_t rows, int64_t oh_lo, int64_t dy_rows);
int mg_dw_grad_weight_f32(const mg_conv_geom *g, const float *x, const float *dy, float *dw);
int mg_dw_grad_weight_f64(const mg_conv_geom *g, const double *x, const double *dy, double *dw);
"""
