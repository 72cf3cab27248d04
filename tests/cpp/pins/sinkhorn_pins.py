"""Independent float64 values of the spec's Sinkhorn mix (spec: Forward step 5), pinned in
tests/cpp/reference_test.cc (ReferenceConstants.Sinkhorn*). Written from the spec's text alone with
NumPy, sharing no code with src/core/reference.cc; run it to regenerate the constants:

    .venv/bin/python tests/cpp/pins/sinkhorn_pins.py
"""

import numpy as np

# (n, iterations, eps): logits are row-major A[i, j] = 0.7 * (i + 1) * (-1)**j + 0.3 * j - 0.2 * i * i, so
# rows differ and the matrix is not symmetric.
CASES = [(2, 1, 1e-6), (2, 3, 0.05), (3, 1, 0.05), (3, 3, 1e-6)]


def logits(n):
    return np.array([[0.7 * (i + 1) * (-1) ** j + 0.3 * j - 0.2 * i * i for j in range(n)] for i in range(n)])


def sinkhorn(a, iterations, eps):
    s = np.exp(a - a.max(axis=1, keepdims=True))
    s = s / s.sum(axis=1, keepdims=True) + eps  # softmax over each row, then + eps
    s = s / (s.sum(axis=0, keepdims=True) + eps)  # columns
    for _ in range(iterations - 1):
        s = s / (s.sum(axis=1, keepdims=True) + eps)  # rows
        s = s / (s.sum(axis=0, keepdims=True) + eps)  # columns
    return s


if __name__ == "__main__":
    for n, iterations, eps in CASES:
        values = ", ".join(f"{float(v)!r}" for v in sinkhorn(logits(n), iterations, eps).ravel())
        print(f"{{{n}, {iterations}, {eps!r}, {{{values}}}}},")
