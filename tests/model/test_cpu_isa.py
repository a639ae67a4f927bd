"""Both kernel families on whatever CPU the suite runs on.

On a CPU with AVX512_BF16 and VNNI the native ops take the AVX-512 kernels (bf16 prefill
tiles and GEMV, VNNI int8 and int4), and with AMX-BF16 the AMX prefill tiles;
``KVSERVE_CPU_ISA=avx2`` keeps the AVX2 family instead, ``KVSERVE_CPU_ISA=avx512`` the
AVX-512 one without AMX. The kernel tests run again under each in a subprocess, so a CI
machine of any class checks the fallbacks too (where the CPU lacks a family, the runs take
the same paths).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model.kernels.native import load_native_ops

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="needs the native kernels")

ROOT = Path(__file__).resolve().parents[2]
AVX2_ONLY = {**os.environ, "KVSERVE_CPU_ISA": "avx2"}
NO_AMX = {**os.environ, "KVSERVE_CPU_ISA": "avx512"}
SUPPORT = (
    "import torch\n"
    "from engine.model.kernels.native import load_native_ops\n"
    "assert load_native_ops()\n"
    "ops = torch.ops.kvserve\n"
    "print(ops.bf16_linear_supported(), ops.int8_vnni_supported(), ops.amx_available())\n"
)


def kernel_support(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SUPPORT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.split()[-3:]


def test_the_override_turns_the_avx512_kernels_off():
    assert kernel_support(AVX2_ONLY) == ["False", "False", "False"]


def test_the_avx512_override_keeps_bf16_and_vnni_but_not_amx():
    unconstrained = {k: v for k, v in os.environ.items() if k != "KVSERVE_CPU_ISA"}
    here = kernel_support(unconstrained)[:2]
    assert kernel_support(NO_AMX) == [*here, "False"]


def assert_tests_pass(env: dict[str, str], *selection: str) -> None:
    """Runs pytest on ``selection`` in a subprocess under ``env``; fails with its output."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def test_the_prefill_tests_pass_on_the_avx512_kernels():
    """On an AMX machine the bf16 prefill cases otherwise never reach the vdpbf16ps kernel."""
    assert_tests_pass(
        NO_AMX,
        "-k",
        "prefill",
        "tests/model/test_native_kernels.py",
        "tests/model/test_attention_variants.py",
    )


def test_the_kernel_tests_pass_on_the_avx2_family():
    assert_tests_pass(
        AVX2_ONLY,
        "tests/model/test_native_kernels.py",
        "tests/model/test_linear_kernels.py",
        "tests/model/test_cpu_decode.py",
        "tests/model/test_attention_variants.py",
        "tests/model/test_int4_weights.py::test_int4_linear_computes_its_reference",
    )
