"""Both kernel families on whatever CPU the suite runs on.

On a CPU with AVX512_BF16 and VNNI the native ops take the AVX-512 kernels (bf16 prefill
tiles and GEMV, VNNI int8 and int4); ``KVSERVE_CPU_ISA=avx2`` keeps the AVX2 family
instead. The kernel tests run again under it in a subprocess, so a CI machine of either
class checks the fallbacks too (on an AVX2-only machine both runs take the same paths).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model.native import load_native_ops

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")

ROOT = Path(__file__).resolve().parents[2]
AVX2_ONLY = {**os.environ, "KVSERVE_CPU_ISA": "avx2"}
SUPPORT = (
    "import torch\n"
    "from engine.model.native import load_native_ops\n"
    "assert load_native_ops()\n"
    "print(torch.ops.kvserve.bf16_linear_supported(), torch.ops.kvserve.int8_vnni_supported())\n"
)


def test_the_override_turns_the_avx512_kernels_off():
    done = subprocess.run(
        [sys.executable, "-c", SUPPORT],
        env=AVX2_ONLY,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.split()[-2:] == ["False", "False"]


def test_the_kernel_tests_pass_on_the_avx2_family():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/model/test_native_kernels.py",
            "tests/model/test_int4_weights.py::test_int4_linear_computes_its_reference",
        ],
        env=AVX2_ONLY,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
