"""The checks every Pallas kernel gets, in one base class: on fresh random inputs at the op's edge
sizes, run in Pallas' interpreter through the op's public entry point, the kernels launched are the
ones expected and the results match the pure-jnp reference; and at the model's sizes, the op lowers
for an H200 (no GPU needed) to the expected custom calls.

An op's test module subclasses `KernelCase` as `Test<Op>` and fills in `inputs`, `kernel`,
`reference`, `cases`, `kernels`, and `lowering_args` with `lowering_cases`; `compare` defaults to the
largest relative error of each result under `tolerance`. The random draws come from one seed per
session (tests/conftest.py: a new one each run, printed in the header; `--kernel-seed N` repeats a
run), folded with each case's name.
"""

import re
import zlib

import jax
import numpy as np
from conftest import relative_error, traced_kernels

from pallas_kernels.common import lower_for_h200


class KernelCase:
    cases: dict = {}  # case name -> keyword arguments of `inputs` (the op's edge sizes)
    kernels: dict = {}  # kernel name -> launches of one call, as `traced_kernels` counts them
    tolerance: float = 0.0
    lowering_cases: dict = {}  # case name -> (keyword arguments of `lowering_args`, the custom calls in order)

    def inputs(self, key, **shape):
        """(args, kwargs) of one call on random data."""
        raise NotImplementedError

    def kernel(self, *args, interpret=True, **kwargs):
        """The op through its public entry point with the kernels asked for."""
        raise NotImplementedError

    def reference(self, *args, **kwargs):
        raise NotImplementedError

    def lowering_args(self, **shape):
        """(args as jax.ShapeDtypeStruct, kwargs) of a call at the model's sizes."""
        raise NotImplementedError

    def compare(self, got, want, **shape):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
            assert relative_error(g, w) < self.tolerance, relative_error(g, w)

    def test_kernel_matches_the_reference_on_fresh_inputs(self, edge_case, kernel_seed):
        shape = self.cases[edge_case]
        key = jax.random.fold_in(jax.random.key(kernel_seed), zlib.crc32(edge_case.encode()))
        args, kwargs = self.inputs(key, **shape)
        assert traced_kernels(lambda: self.kernel(*args, **kwargs)) == self.kernels, f"seed {kernel_seed}"
        got = self.kernel(*args, **kwargs)
        want = self.reference(*args, **kwargs)
        self.compare(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want), **shape)

    def test_lowers_for_an_h200(self, lowering_case):
        shape, calls = self.lowering_cases[lowering_case]
        args, kwargs = self.lowering_args(**shape)
        text = lower_for_h200(lambda *a: self.kernel(*a, interpret=False, **kwargs), *args).as_text()
        assert re.findall(r"custom_call @([\w$.]+)", text) == list(calls)
