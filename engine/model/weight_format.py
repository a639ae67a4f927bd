"""The byte layout of quantized weights, and which quantization runs where (torch-free).

One source for the constants that both the linear layers (``layers/linear.py``) and the
capacity planner (``server/plan.py``) count with: the planner sizes a deployment without
importing torch's kernels, and the layers store exactly what it counted.
"""

from __future__ import annotations

QUANTIZATION_METHODS: tuple[str, ...] = ("none", "int8", "int4")
# The row-major int8 copy keeps one float32 scale per output channel beside its weights.
ROWWISE_CHANNEL_BYTES = 4
INT8_MAX = 127
# fbgemm keeps one float32 scale and one int32 zero point per output channel.
INT8_CHANNEL_OVERHEAD_BYTES = 4 + 4
# int4 (Q4_1): 32 weights per group, two per byte, and a float16 scale and minimum.
INT4_GROUP = 32
INT4_LEVELS = 15
INT4_GROUP_OVERHEAD_BYTES = 2 + 2


def check_quantization(method: str, device_type: str, kernels: str = "native") -> None:
    """Reject an unknown method, int8/int4 off the CPU, and int4 without the native
    kernels (``kernels`` names the backend in use), with messages naming the flag."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization must be one of {list(QUANTIZATION_METHODS)}, not {method!r}"
        )
    if method != "none" and device_type != "cpu":
        raise ValueError(
            f"--quantization {method} runs on the CPU only, not on {device_type}; "
            "use --quantization none (or --device cpu)"
        )
    if method == "int4" and kernels != "native":
        raise ValueError(
            "--quantization int4 runs on the native CPU kernels, which are not in use "
            "(--kernels torch, or they failed to build: see the warning above); "
            "use --kernels auto or --quantization int8"
        )
