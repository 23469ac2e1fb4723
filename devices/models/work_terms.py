"""The fitted form the compute models share: time as a sum of work terms.

``t = Σ_j W_j · exp(X_j · θ_j)``: each term is a work measure (FLOPs, bytes moved, calls)
at a reference rate, times a log-linear efficiency of the shape's features. The GEMM model
(``compute``) and the convolution model (``conv``) each say what their terms are; fitting
them, predicting with them and scoring them on held-out measurements is the same, and
lives here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from .strict_map import check_keys, positive

# (work, design) per term: work [samples], design [samples, parameters of the term].
Terms = list[tuple[np.ndarray, np.ndarray]]

_MEMO_LIMIT = 1 << 16  # predictions kept: tiles repeat step after step; bound anyway
_RIDGE = 1e-2  # keeps terms the measurements barely cover near θ = 0
_LOSS_SCALE = 0.05  # soft-L1 knee in log time: points off by > 5 % count linearly


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each (non-negative) integer."""
    count = np.zeros_like(x)
    while (x > 0).any():
        count += x & 1
        x = x >> 1
    return count


def hats(u: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Piecewise-linear basis: each row interpolates between its two nearest knots."""
    u = np.clip(u, knots[0], knots[-1])
    i = np.clip(np.searchsorted(knots, u, side="right") - 1, 0, len(knots) - 2)
    w = (u - knots[i]) / (knots[i + 1] - knots[i])
    out = np.zeros((u.size, knots.size))
    rows = np.arange(u.size)
    out[rows, i] = 1.0 - w
    out[rows, i + 1] = w
    return out


def one_hot(index: np.ndarray, count: int) -> np.ndarray:
    out = np.zeros((index.size, count))
    out[np.arange(index.size), index] = 1.0
    return out


def predict(terms: Terms, theta: np.ndarray) -> np.ndarray:
    """Seconds per sample: the sum of the terms at parameters ``theta``."""
    total = np.zeros(terms[0][0].size)
    start = 0
    for work, design in terms:
        width = design.shape[1]
        total += work * np.exp(design @ theta[start : start + width])
        start += width
    return total


def term_costs(terms: Terms, theta: np.ndarray) -> list[np.ndarray]:
    """Seconds per sample of each term (they sum to ``predict``)."""
    costs, start = [], 0
    for work, design in terms:
        width = design.shape[1]
        costs.append(work * np.exp(design @ theta[start : start + width]))
        start += width
    return costs


def least_squares(
    terms: Terms, seconds: np.ndarray, theta0: np.ndarray, max_nfev: int
) -> tuple[np.ndarray, float]:
    """Robust least squares in log time, with the analytic Jacobian; (θ, cost)."""
    log_t = np.log(seconds)
    ridge = math.sqrt(_RIDGE)
    eye = ridge * np.eye(theta0.size)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.concatenate([np.log(predict(terms, theta)) - log_t, ridge * theta])

    def jacobian(theta: np.ndarray) -> np.ndarray:
        costs = term_costs(terms, theta)
        total = np.sum(costs, axis=0)
        shares = [cost / total for cost in costs]
        blocks = [share[:, None] * design for share, (_, design) in zip(shares, terms, strict=True)]
        return np.concatenate([np.concatenate(blocks, axis=1), eye])

    from scipy.optimize import least_squares as solve  # (here: scipy costs every command 0.5 s)

    # LSMR, not the default SVD: LAPACK's threads spin-wait when another process holds a
    # core, which made one fit 25x slower on the shared 2-core development host.
    result = solve(
        residuals,
        theta0,
        jac=jacobian,
        method="trf",
        loss="soft_l1",
        f_scale=_LOSS_SCALE,
        tr_solver="lsmr",
        max_nfev=max_nfev,
    )
    return result.x, float(result.cost)


Shape = TypeVar("Shape", contravariant=True)


class Predictor(Protocol[Shape]):
    def predict_many(self, shapes: Sequence[Shape]) -> np.ndarray: ...


def heldout_error(
    model: Predictor[Shape], samples: Sequence[tuple[Shape, float]]
) -> dict[str, float]:
    """Absolute percentage errors of ``model`` on measured samples, as fractions (0.05 = 5 %).

    Samples should be shapes the model was not fitted to; measured shapes come from the
    exact cache and score zero.
    """
    if not samples:
        raise ValueError("heldout_error needs at least one sample")
    predicted = model.predict_many([shape for shape, _ in samples])
    measured = np.array([positive("sample", "seconds", seconds) for _, seconds in samples])
    ape = np.abs(predicted / measured - 1.0)
    return {
        "median_ape": float(np.median(ape)),
        "p90_ape": float(np.percentile(ape, 90)),
        "max_ape": float(ape.max()),
        "count": int(ape.size),
    }


S = TypeVar("S", bound=Hashable)


class ShapeModel(ABC, Generic[S]):
    """Seconds per call of a shape at the device's top clock: a measured shape's time from
    the exact cache, any other's from the model (``_model``: a fitted form, or published
    figures), remembered."""

    def __init__(self, exact: Mapping[S, float]) -> None:
        self.exact = dict(exact)
        self._memo: dict[S, float] = {}

    def predict_s(self, shape: S) -> float:
        """Seconds for one call of ``shape``."""
        hit = self.exact.get(shape)
        if hit is not None:
            return hit
        hit = self._memo.get(shape)
        if hit is None:
            hit = float(self._model([shape])[0])
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[shape] = hit
        return hit

    def predict_many(self, shapes: Sequence[S]) -> np.ndarray:
        """``predict_s`` for many shapes at once."""
        out = self._model(shapes) if shapes else np.zeros(0)
        for i, shape in enumerate(shapes):
            hit = self.exact.get(shape)
            if hit is not None:
                out[i] = hit
        return out

    @abstractmethod
    def _model(self, shapes: Sequence[S]) -> np.ndarray:
        """Seconds for each of ``shapes`` by the model alone."""


def theta_by_term(theta: np.ndarray, widths: Mapping[str, int]) -> dict[str, list[float]]:
    """θ as a model's ``to_dict`` writes it: each term's parameters under its name."""
    out, start = {}, 0
    for name, width in widths.items():
        out[name] = theta[start : start + width].tolist()
        start += width
    return out


def exact_from(
    what: str, records: object, fields: Sequence[str], shape: Callable[[dict[str, Any]], S]
) -> dict[S, float]:
    """A model's exact cache from ``to_dict``'s list of records (each shape's ``fields`` and
    its ``seconds``), strictly: every error names ``what`` model's field."""
    if not isinstance(records, list):
        raise ValueError(f"{what} field 'exact' must be a list of records")
    exact = {}
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{what} field 'exact'[{i}] must be a table, got {record!r:.60}")
        check_keys(f"{what} field 'exact'[{i}]", record, (*fields, "seconds"))
        key = shape({name: record[name] for name in fields})
        exact[key] = positive(what, f"exact[{i}].seconds", record["seconds"])
    return exact
