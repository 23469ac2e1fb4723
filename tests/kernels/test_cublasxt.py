"""cuBLASXt on host pointers: real on a GPU host, a stated reason elsewhere."""

from __future__ import annotations

import re

import numpy as np
import pytest
from morphling.kernels import CublasXt, cublasxt_status

STATUS = cublasxt_status()
needs_gpu = pytest.mark.skipif(STATUS != "available", reason=f"cuBLASXt {STATUS}")


@pytest.mark.skipif(STATUS == "available", reason="this host has a usable GPU")
def test_unavailable_names_the_missing_piece():
    assert STATUS.startswith("unavailable: ")
    assert "libcuda" in STATUS or "cuBLAS" in STATUS or "CUDA" in STATUS
    with pytest.raises(RuntimeError, match=re.escape(STATUS)):
        CublasXt()


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 1, 1), (17, 33, 5), (256, 128, 300), (1000, 999, 64)]
)
def test_matches_numpy_with_transposes_and_batches(dtype, m, n, k):
    rng = np.random.default_rng(m + n + k)
    xt = CublasXt(block_dim=256)
    a = rng.standard_normal((m, k + 3)).astype(dtype)[:, :k]  # padded rows
    b = np.ascontiguousarray(rng.standard_normal((n, k)).astype(dtype)).T  # column-major
    tol = (
        {"rtol": 1e-4, "atol": 1e-4 * k} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-10}
    )
    np.testing.assert_allclose(xt.gemm(a, b), a @ b, **tol)
    batched = rng.standard_normal((3, m, k)).astype(dtype)
    np.testing.assert_allclose(xt.gemm(batched, b), batched @ b, **tol)
    xt.close()


@needs_gpu
def test_bad_device_and_block_dim():
    with pytest.raises(ValueError, match="devices="):
        CublasXt(devices=[999])
    with pytest.raises(ValueError, match="block_dim"):
        CublasXt(block_dim=-1)
