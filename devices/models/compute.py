"""How long one GEMM tile takes on a device: measured shapes exactly, the rest from a fit.

The virtual clock asks a device's ``ComputeModel`` for every tile. Shapes the profiler
measured come from an exact cache; others from a model fitted to those measurements, or,
for built-in profiles that only have published peak figures, from ``2·m·n·k / flops``.

Why the fitted model has the form it has (measured with MKL on one core; see
``morphling profile``): time is a sum of work terms, each a work measure times a
log-linear efficiency, ``t = Σ_j W_j · exp(X_j · θ_j)``:

- overhead: a constant per call;
- compute: ``2·m·n'·k`` FLOPs, where ``n'`` counts the columns the micro-kernel really
  computes. BLAS vectorises C's rows in panels of ``vector_bytes``; a partial panel costs a
  whole one, and on the packed path (both m and n at least ``regime_min``) MKL covers the
  remainder with 8-, 4-, 2- and 1-wide kernels that each cost about a full panel (n = 255
  takes 20 % longer than n = 256). Efficiency depends on dtype, transposes, path and k;
- operand traffic for A and for B: bytes × a power law in (m, n, k) per group of
  (transposed?, stride class, path, dtype). The stride class is where REFERENCE.md's "stride
  matters" lives: rows a page multiple apart map to the same cache sets and defeat the
  prefetcher (pages are fetched one row at a time), sub-page power-of-two strides alias in
  L1, rows more than a page apart defeat the prefetcher only. The penalty is not a constant
  factor: below MKL's packing threshold (m or n under ~190 here) a page-multiple leading
  dimension costs 1.5-4× as the kernel re-reads the strided operand; above it, packing
  copies the operand once and costs 2-10 %. A penalty factor per class cannot say that; a
  cost per byte per class and path, scaling with the shape, can;
- writing C: bytes of C.

The two structural choices, the panel width and the packing threshold, are picked by
comparing fits on the host's own measurements (here: 64 bytes, AVX-512, and 197). With
2000-3000 grid shapes the form predicts held-out shapes of interest with a median error
of about 3 % and a p90 of 8-11 % on the shared 2-core development host. On the same
measurements a multiplicative form (a saturating efficiency x/(x+h) per dimension times a
factor per transpose, dtype and stride class) reached a median of 6 % and a p90 of 16 %.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .strict_map import check_keys, floats, positive
from .work_terms import (
    ShapeModel,
    Terms,
    exact_from,
    hats,
    least_squares,
    one_hot,
    popcount,
    predict,
    term_costs,
    theta_by_term,
)
from .work_terms import heldout_error as heldout_error  # where callers of the GEMM model look

DTYPES = {"float32": 4, "float64": 8}
PAGE_BYTES = 4096
_INT_MAX = 2**31 - 1  # the 32-bit BLAS interface

_SHAPE_FIELDS = ("m", "n", "k", "ta", "tb", "lda", "ldb", "dtype")


def _dim(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT_MAX:
        raise ValueError(f"GEMM field {name!r} must be an integer in 1..{_INT_MAX}, got {value!r}")


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One row-major GEMM ``C[m, n] = op(A)[m, k] · op(B)[k, n]`` as the engine has it per tile.

    ``A`` is stored as ``k`` rows of ``m`` (``ta``) or ``m`` rows of ``k``, ``lda`` elements
    apart; likewise ``B`` as ``n`` rows of ``k`` (``tb``) or ``k`` rows of ``n``. ``C`` is
    written contiguous (``ldc = n``).
    """

    m: int
    n: int
    k: int
    ta: bool
    tb: bool
    lda: int
    ldb: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "lda", "ldb"):
            _dim(name, getattr(self, name))
        for name in ("ta", "tb"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"GEMM field {name!r} must be a bool, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"GEMM field 'dtype' must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.lda < self.a_cols:
            raise ValueError(
                f"GEMM field 'lda' must be >= A's stored row length {self.a_cols} "
                f"(ta={self.ta}), got {self.lda}"
            )
        if self.ldb < self.b_cols:
            raise ValueError(
                f"GEMM field 'ldb' must be >= B's stored row length {self.b_cols} "
                f"(tb={self.tb}), got {self.ldb}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def a_rows(self) -> int:
        return self.k if self.ta else self.m

    @property
    def a_cols(self) -> int:
        return self.m if self.ta else self.k

    @property
    def b_rows(self) -> int:
        return self.n if self.tb else self.k

    @property
    def b_cols(self) -> int:
        return self.k if self.tb else self.n

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SHAPE_FIELDS}


# --- the fitted form -------------------------------------------------------------------------

# Reference magnitudes: the work measures are scaled so that θ = 0 is a plausible CPU.
_REF_OVERHEAD_S = 1e-6
_REF_FLOPS = 1e11
_REF_BYTES_PER_S = 1e10

# log2(m), log2(n), log2(k) are centred here; efficiencies are held at the edge of the
# measured range beyond it (work still scales), so extrapolation stays sane.
_LOG2_CENTRE = (5.0, 5.0, 8.0)
_K_KNOTS = np.array([4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0]) - _LOG2_CENTRE[2]

# Stride classes of an operand's leading dimension in bytes, and the operand groups.
_NEAR, _FAR, _POW2, _PAGE = range(4)
_STRIDE_CLASSES = 4
_GROUPS = 2 * _STRIDE_CLASSES * 2 * 2  # transposed? × stride class × packed path? × fp64?
_COVARIATES = 4  # 1, log2 m, log2 n, log2 k

# Parameter vector layout: name → length; compute's columns are fp32, fp64 (rate per
# dtype), (ta, tb) = (0,1), (1,0), (1,1), packed path, k knots, m == 1, n == 1 (GEMV).
_TERMS = {
    "overhead": 1,
    "compute": 2 + 3 + 1 + len(_K_KNOTS) + 2,
    "a_traffic": _GROUPS * _COVARIATES,
    "b_traffic": _GROUPS * _COVARIATES,
    "c_traffic": 1,
}

VECTOR_BYTES_CANDIDATES = (16, 32, 64)
# Packing thresholds tried: geometric midpoints, four per octave from 64 to 512.
REGIME_CANDIDATES = tuple(round(64 * 2 ** ((i + 0.5) / 4)) for i in range(12))
NO_REGIME = 0  # regime_min value meaning "one path for every shape"

_SEARCH_SAMPLES = 800  # structure is chosen on at most this many samples
_SEARCH_NFEV = 60
_FINAL_NFEV = 400


class _Columns:
    """The shapes' fields as arrays, so a design is built for thousands at once."""

    def __init__(self, shapes: Sequence[GemmShape]) -> None:
        rows = [(s.m, s.n, s.k, s.ta, s.tb, s.lda, s.ldb, s.itemsize) for s in shapes]
        table = np.array(rows, dtype=np.int64).reshape(-1, 8)
        self.m, self.n, self.k, self.ta, self.tb, self.lda, self.ldb, self.item = table.T
        self.size = table.shape[0]


def _stride_class(ld: np.ndarray, item: np.ndarray) -> np.ndarray:
    """near, far (rows over a page apart), pow2 (sub-page power of two ≥ 512 B), page."""
    stride = ld * item
    pow2 = (stride & (stride - 1)) == 0
    return np.where(
        stride % PAGE_BYTES == 0,
        _PAGE,
        np.where(pow2 & (stride >= 512), _POW2, np.where(stride > PAGE_BYTES, _FAR, _NEAR)),
    )


@dataclass(frozen=True, slots=True)
class _Form:
    """The structural choices and the measured range; everything but θ."""

    vector_bytes: int
    regime_min: int
    log2_min: tuple[float, float, float]
    log2_max: tuple[float, float, float]

    def terms(self, c: _Columns) -> Terms:
        """(work, design) per term, in ``_TERMS`` order."""
        m, n, k = (c.m.astype(np.float64), c.n.astype(np.float64), c.k.astype(np.float64))
        logs = [
            np.clip(np.log2(x), lo, hi) - centre
            for x, lo, hi, centre in zip(
                (m, n, k), self.log2_min, self.log2_max, _LOG2_CENTRE, strict=True
            )
        ]
        packed = (
            np.zeros(c.size, dtype=np.int64)
            if self.regime_min == NO_REGIME
            else ((c.m >= self.regime_min) & (c.n >= self.regime_min)).astype(np.int64)
        )
        per_panel = np.maximum(self.vector_bytes // c.item, 1)
        full, rest = np.divmod(c.n, per_panel)
        panels = full + np.where(packed == 1, popcount(rest), rest > 0)
        fp64 = (c.item == 8).astype(np.int64)
        transposes = c.ta * 2 + c.tb
        compute = np.concatenate(
            [
                one_hot(fp64, 2),
                one_hot(transposes, 4)[:, 1:],
                packed[:, None].astype(np.float64),
                hats(logs[2], _K_KNOTS),
                np.stack([m == 1, n == 1], axis=1).astype(np.float64),
            ],
            axis=1,
        )
        covariates = np.stack([np.ones(c.size), *logs], axis=1)

        def traffic(trans: np.ndarray, ld: np.ndarray) -> np.ndarray:
            group = ((trans * _STRIDE_CLASSES + _stride_class(ld, c.item)) * 2 + packed) * 2 + fp64
            design = one_hot(group, _GROUPS)[:, :, None] * covariates[:, None, :]
            return design.reshape(c.size, -1)

        ones = np.ones((c.size, 1))
        item = c.item.astype(np.float64)
        return [
            (np.full(c.size, _REF_OVERHEAD_S), ones),
            (2.0 * m * panels * per_panel * k / _REF_FLOPS, compute),
            (m * k * item / _REF_BYTES_PER_S, traffic(c.ta, c.lda)),
            (k * n * item / _REF_BYTES_PER_S, traffic(c.tb, c.ldb)),
            (m * n * item / _REF_BYTES_PER_S, ones),
        ]


# --- the model -------------------------------------------------------------------------------

_Trial = tuple[float, _Form, np.ndarray]  # robust cost, structure, θ

_ANALYTIC_KEYS = ("kind", "flops", "fp64_ratio", "exact")
_FITTED_KEYS = ("kind", "vector_bytes", "regime_min", "log2_min", "log2_max", *_TERMS, "exact")


def _positive(name: str, value: object) -> float:
    return positive("compute", name, value)


def _floats(name: str, value: object, length: int) -> tuple[float, ...]:
    return floats("compute", name, value, length)


def _exact(records: object) -> dict[GemmShape, float]:
    return exact_from("compute", records, _SHAPE_FIELDS, lambda fields: GemmShape(**fields))


class ComputeModel(ShapeModel[GemmShape]):
    """Seconds per GEMM at the device's top clock: exact cache first, then the model.

    Build one with ``fit`` (measurements), ``analytic`` (a peak figure) or ``from_dict``.
    """

    def __init__(
        self,
        exact: Mapping[GemmShape, float],
        *,
        form: _Form | None = None,
        theta: Sequence[float] | np.ndarray | None = None,
        flops: float | None = None,
        fp64_ratio: float = 0.5,
    ) -> None:
        if (form is None) == (flops is None) or (form is None) != (theta is None):
            raise ValueError("a ComputeModel is either fitted (form, theta) or analytic (flops)")
        super().__init__(exact)
        self._form = form
        self._theta = None if theta is None else np.array(theta, dtype=np.float64)
        self.flops = None if flops is None else _positive("flops", flops)
        self.fp64_ratio = _positive("fp64_ratio", fp64_ratio)

    # construction

    @classmethod
    def analytic(cls, flops: float, *, fp64_ratio: float = 0.5) -> ComputeModel:
        """``2·m·n·k / flops`` (fp64 at ``fp64_ratio`` of the fp32 rate): published peaks."""
        return cls({}, flops=flops, fp64_ratio=fp64_ratio)

    @classmethod
    def fit(cls, samples: Iterable[tuple[GemmShape, float]]) -> ComputeModel:
        """Fit to measured (shape, seconds); the samples also become the exact cache.

        The panel width and packing threshold are chosen by the lowest robust cost of fits
        on (a spread subset of) the samples; θ is then fitted on all of them.
        """
        exact: dict[GemmShape, float] = {}
        for shape, measured_s in samples:
            if not isinstance(shape, GemmShape):
                raise ValueError(f"sample shape must be a GemmShape, got {shape!r:.60}")
            value = _positive("seconds", measured_s)
            exact[shape] = min(value, exact.get(shape, math.inf))
        if len(exact) < sum(_TERMS.values()) // 4:
            raise ValueError(f"fit needs at least {sum(_TERMS.values()) // 4} distinct shapes")
        shapes = list(exact)
        seconds = np.array([exact[s] for s in shapes])
        columns = _Columns(shapes)
        logs = np.log2(np.stack([columns.m, columns.n, columns.k]).astype(np.float64))
        bounds = (tuple(logs.min(axis=1).tolist()), tuple(logs.max(axis=1).tolist()))
        step = -(-len(shapes) // _SEARCH_SAMPLES)
        subset = _Columns(shapes[::step])
        sub_seconds = seconds[::step]
        zero = np.zeros(sum(_TERMS.values()))

        def trial(vector_bytes: int, regime_min: int, start: np.ndarray) -> _Trial:
            form = _Form(vector_bytes, regime_min, *bounds)
            theta, cost = least_squares(form.terms(subset), sub_seconds, start, _SEARCH_NFEV)
            return cost, form, theta

        best = min((trial(v, NO_REGIME, zero) for v in VECTOR_BYTES_CANDIDATES), key=lambda r: r[0])
        best = min(best, _descend(trial, best), key=lambda r: r[0])
        form = best[1]
        theta, _ = least_squares(form.terms(columns), seconds, best[2], _FINAL_NFEV)
        return cls(exact, form=form, theta=theta)

    # prediction

    def _model(self, shapes: Sequence[GemmShape]) -> np.ndarray:
        if self._form is None:
            assert self.flops is not None
            rate = np.array(
                [self.flops * (self.fp64_ratio if s.dtype == "float64" else 1.0) for s in shapes]
            )
            seconds: np.ndarray = np.array([s.flops for s in shapes], dtype=np.float64) / rate
            return seconds
        assert self._theta is not None
        return predict(self._form.terms(_Columns(shapes)), self._theta)

    def traffic_cost(self, shape: GemmShape) -> tuple[float, float]:
        """Seconds the fitted model charges for moving A and for moving B in ``shape``.

        Comparing shapes that differ only in a leading dimension shows the fitted stride
        penalty (an analytic model has none: (0, 0)).
        """
        if self._form is None:
            return 0.0, 0.0
        assert self._theta is not None
        cost = term_costs(self._form.terms(_Columns([shape])), self._theta)
        return float(cost[2][0]), float(cost[3][0])

    # serialisation

    def to_dict(self) -> dict[str, Any]:
        """A TOML- and msgpack-friendly map (the exact cache as a list of records)."""
        exact = [{**s.to_dict(), "seconds": t} for s, t in self.exact.items()]
        if self._form is None:
            analytic = {"kind": "analytic", "flops": self.flops, "fp64_ratio": self.fp64_ratio}
            return {**analytic, "exact": exact}
        assert self._theta is not None
        out: dict[str, Any] = {
            "kind": "fitted",
            "vector_bytes": self._form.vector_bytes,
            "regime_min": self._form.regime_min,
            "log2_min": list(self._form.log2_min),
            "log2_max": list(self._form.log2_max),
        }
        return {**out, **theta_by_term(self._theta, _TERMS), "exact": exact}

    @classmethod
    def from_dict(cls, d: object) -> ComputeModel:
        """Parse ``to_dict``'s map strictly: unknown or missing keys are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"compute model must be a map, got {type(d).__name__}")
        kind = d.get("kind")
        if kind == "analytic":
            check_keys("compute model", d, _ANALYTIC_KEYS)
            flops = _positive("flops", d["flops"])
            fp64_ratio = _positive("fp64_ratio", d["fp64_ratio"])
            return cls(_exact(d["exact"]), flops=flops, fp64_ratio=fp64_ratio)
        if kind != "fitted":
            raise ValueError(
                f"compute field 'kind' must be 'analytic' or 'fitted', got {kind!r:.60}"
            )
        check_keys("compute model", d, _FITTED_KEYS)
        vector_bytes, regime_min = d["vector_bytes"], d["regime_min"]
        for name, value in (("vector_bytes", vector_bytes), ("regime_min", regime_min)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"compute field {name!r} must be an integer >= 0, got {value!r:.60}"
                )
        if vector_bytes < 1:
            raise ValueError(f"compute field 'vector_bytes' must be >= 1, got {vector_bytes}")
        low = _floats("log2_min", d["log2_min"], 3)
        high = _floats("log2_max", d["log2_max"], 3)
        if any(lo > hi for lo, hi in zip(low, high, strict=True)):
            raise ValueError("compute field 'log2_min' must not exceed 'log2_max'")
        theta = [x for name, width in _TERMS.items() for x in _floats(name, d[name], width)]
        form = _Form(vector_bytes, regime_min, low, high)  # type: ignore[arg-type]
        return cls(_exact(d["exact"]), form=form, theta=theta)


def _descend(trial: Callable[[int, int, np.ndarray], _Trial], best: _Trial) -> _Trial:
    """Walk the packing-threshold candidates downhill from the middle; the best trial."""
    _, form, theta = best
    results: dict[int, _Trial] = {}

    def at(i: int) -> _Trial:
        if i not in results:
            results[i] = trial(form.vector_bytes, REGIME_CANDIDATES[i], theta)
        return results[i]

    i = len(REGIME_CANDIDATES) // 2
    while True:
        neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(REGIME_CANDIDATES)]
        j = min([i, *neighbours], key=lambda j: at(j)[0])
        if j == i:
            return at(i)
        i = j
