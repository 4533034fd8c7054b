"""The suite's C kernels build wherever a C compiler exists. A kernel that fails to build falls back
to PyTorch in a sweep (its record says which ran), so without this test a broken kernel would only
turn its own tests into skips and CI would stay green."""

from __future__ import annotations

import pytest

from variants import decode_kernel, sparse_kernel

from .helpers import needs_c_compiler


@needs_c_compiler
@pytest.mark.parametrize("kernel", [sparse_kernel, decode_kernel], ids=["sparse_kernel", "decode_kernel"])
def test_each_c_kernel_builds_where_a_compiler_exists(kernel):
    assert kernel.kernel() is not None, kernel.build_error()
