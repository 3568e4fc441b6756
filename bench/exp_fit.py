"""The coefficients of the oracle's exp on its reduced range (src/sim/reference_attention.cpp,
exp_lanes): e^r = 1 + r·P(r) for |r| ≤ ln2/2, P the polynomial of degree N − 1 that interpolates
P*(r) = (e^r − 1)/r at N Chebyshev points of [−ln2/2, ln2/2] (60-digit arithmetic, mpmath), so
that e^r is a polynomial of degree N whose constant term is exactly 1. Prints, per degree, the
largest relative error of 1 + r·P(r) against e^r (exact arithmetic: the approximation alone, in
units of 2⁻⁵³) over 20,001 points, and Taylor's polynomial of the same degree beside it; then
the coefficients of the degree kept (11: Taylor's needs 13 for the same error, each degree one
multiply-add per value). The rounding of the float64 evaluation is measured by the unit test
(within 1 ulp of glibc's exp) and by `exp_ulps` below.

    .venv/bin/python bench/exp_fit.py [--degree 11]
"""
import argparse

import mpmath as mp

mp.mp.dps = 60
HALF = mp.log(2) / 2


def target(r):
    return mp.mpf(1) if r == 0 else mp.expm1(r) / r


def fit(degree):
    count = degree  # P has degree − 1
    nodes = [HALF * mp.cos(mp.pi * (2 * k + 1) / (2 * count)) for k in range(count)]
    vander = mp.matrix([[r**j for j in range(count)] for r in nodes])
    coeffs = mp.lu_solve(vander, mp.matrix([target(r) for r in nodes]))
    return [coeffs[j] for j in range(count)]  # P's, from r^0 up


def taylor(degree):
    return [1 / mp.factorial(j + 1) for j in range(degree)]


def worst(coeffs, points=20001):
    w = mp.mpf(0)
    for i in range(points):
        r = -HALF + 2 * HALF * i / (points - 1)
        p = mp.mpf(0)
        for c in reversed(coeffs):
            p = p * r + c
        w = max(w, abs((1 + r * p) / mp.exp(r) - 1))
    return float(w / mp.mpf(2) ** -53)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=11)
    args = ap.parse_args()
    for degree in range(9, 15):
        print(f"degree {degree:2}: interpolated {worst(fit(degree)):10.4f} × 2^-53, "
              f"Taylor {worst(taylor(degree)):12.4f} × 2^-53")
    print(f"degree {args.degree}: the coefficients of r^1 … r^{args.degree} of e^r (P's from r^0 up):")
    for c in fit(args.degree):
        print(f"  {float(c)!r}")


if __name__ == "__main__":
    main()
