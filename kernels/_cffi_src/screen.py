"""Declarations for c/screen.c: stage one of the emulator's Freivalds screen."""

INCLUDES = ""

TYPES = ""

FUNCTIONS = """
int64_t mg_screen_f32(const float *c, int64_t rows, int64_t n, int64_t ldc, int64_t edge,
                      const float *r, const float *ref, int64_t ldref, double unit,
                      double subnormal, double *sums, double *norms);
int64_t mg_screen_f64(const double *c, int64_t rows, int64_t n, int64_t ldc, int64_t edge,
                      const double *r, const double *ref, int64_t ldref, double unit,
                      double subnormal, double *sums, double *norms);
"""
