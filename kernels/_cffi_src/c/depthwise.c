/*
 * Depthwise convolutions: each output channel reads one input channel.
 *
 * Output channel c·M + j (j < M, the channel multiplier) reads input channel c with its
 * own kh × kw taps. numpy did this one tap at a time over whole arrays (einsum for the
 * gradients), whose speed jumped with strides and multipliers; here every pass is a row:
 * an output row (forward, grad weight) or an input row (grad input) is finished while it
 * sits in L1, one tap after another, each tap a loop over the output's columns that the
 * compiler vectorises (contiguous where the column stride is 1). Padding is never
 * materialised: a tap's rows and columns that fall in the padding are skipped.
 *
 * Arrays are NCHW, C-contiguous, one dtype per call; the geometry is kernels/conv.py's
 * (padding above and to the left of the array given; outputs past the last row or column
 * are not asked for). Single-threaded, like every device kernel: a device's workers each
 * run one call. Entry points return 0, or -ENOMEM when a scratch buffer cannot be had.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "conv_geom.h"

#define MG_DW_T float
#define MG_DW_SUFFIX f32
#include "depthwise_typed.h"
#undef MG_DW_T
#undef MG_DW_SUFFIX

#define MG_DW_T double
#define MG_DW_SUFFIX f64
#include "depthwise_typed.h"
#undef MG_DW_T
#undef MG_DW_SUFFIX
