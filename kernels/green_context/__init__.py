"""Green contexts: a GPU throttled to an SM count that follows a trace, by step or wall time.

A virtual GPU device of the fleet can be slowed the way a shared or power-capped GPU
is, by running its GEMMs on a partition of the SMs. The parts:

- ``trace``: the ``# greenctx_trace v2`` format (``GreenTrace``; errors name the line and
  the problem), the SM count as a step function of a step index or of the elapsed time
  since the first GEMM;
- ``controller``: ``GreenContextController`` decides before each GEMM which partition it
  runs on, switches only when that changes, counts switches and their cost, and has an
  off switch;
- ``cuda_partitions``: ``CudaGreenContexts``, the CUDA driver backend behind the small
  ``SmPartitions`` interface the controller drives (partitions, their cuBLAS handles, the
  GEMM path and the teardown order), and whether green contexts are available here.
"""

from .controller import (
    BACKENDS,
    CLOCK_MODES,
    GreenContextConfig,
    GreenContextController,
    SmPartitions,
    SwitchStats,
)
from .cuda_partitions import (
    MIN_DRIVER,
    OFF_ENV,
    CudaGreenContexts,
    cublas_library,
    green_context_status,
    round_sm_count,
    sm_granularity,
)
from .trace import TIME_UNITS, GreenTrace, TraceError, TracePoint

__all__ = [
    "BACKENDS",
    "CLOCK_MODES",
    "MIN_DRIVER",
    "OFF_ENV",
    "TIME_UNITS",
    "CudaGreenContexts",
    "GreenContextConfig",
    "GreenContextController",
    "GreenTrace",
    "SmPartitions",
    "SwitchStats",
    "TraceError",
    "TracePoint",
    "cublas_library",
    "green_context_status",
    "round_sm_count",
    "sm_granularity",
]
