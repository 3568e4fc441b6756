"""The coefficients of the oracle's tanh below |x| = 0.625 (src/sim/reference_attention.cpp,
tanh_lanes): tanh(x) = x + x·z·R(z), z = x², R the polynomial of degree N in z that
interpolates R*(z) = (tanh(x) − x)/(x·z) at N + 1 Chebyshev points of z in [0, 0.625²]
(60-digit arithmetic, mpmath). Prints, per degree, the largest error of the whole formula
evaluated in float64 (Horner) against tanh in 60 digits, in units of 2⁻⁵³ relative, and
against glibc's tanh in ulps, over 100,000 arguments; then the coefficients of the degree
kept (11: the smallest as close to tanh as Cephes' rational with its division, 1.3 units).

    .venv/bin/python bench/tanh_fit.py [--degree 11]
"""
import argparse
import math

import mpmath as mp
import numpy as np

mp.mp.dps = 60
EDGE = mp.mpf("0.625")


def target(z):
    if z == 0:
        return mp.mpf(-1) / 3
    x = mp.sqrt(z)
    return (mp.tanh(x) - x) / (x * z)


def fit(degree):
    top = EDGE**2
    count = degree + 1
    nodes = [top / 2 * (1 + mp.cos(mp.pi * (2 * k + 1) / (2 * count))) for k in range(count)]
    vander = mp.matrix([[z**j for j in range(count)] for z in nodes])
    coeffs = mp.lu_solve(vander, mp.matrix([target(z) for z in nodes]))
    return [float(coeffs[j]) for j in range(count)]


def tanh64(x, coeffs):
    z = x * x
    r = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        r = r * z + c
    return x + x * z * r


def errors(coeffs, xs):
    worst_true = worst_glibc = 0.0
    for x in xs:
        t = tanh64(x, coeffs)
        exact = mp.tanh(mp.mpf(x))
        if exact == 0:
            continue
        worst_true = max(worst_true, float(abs((mp.mpf(t) - exact) / exact)) / 2.0**-53)
        want = math.tanh(x)
        worst_glibc = max(worst_glibc, abs(t - want) / math.ulp(want))
    return worst_true, worst_glibc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=11)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    xs = np.concatenate([np.linspace(1e-9, 0.625, 40001), rng.uniform(0, 0.625, 40000),
                         np.geomspace(1e-300, 0.625, 20000)]).tolist()
    for degree in range(8, 14):
        true, glibc = errors(fit(degree), xs)
        print(f"degree {degree:2}: {true:8.3f} × 2^-53 of tanh, {glibc:5.1f} ulp of glibc's")
    print(f"degree {args.degree}, from z^0 up:")
    for c in fit(args.degree):
        print(f"  {c!r}")


if __name__ == "__main__":
    main()
