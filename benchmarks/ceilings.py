"""The H200's ceilings that the kernel benchmarks report their rates against.

Datasheet peaks (H200 SXM) and the rates this project measured on its own H200 (anchors.md §6):
a row's ``fraction_of_*`` field divides its achieved rate by one of these.
"""

from __future__ import annotations

H200_HBM_GBPS = 4800.0
"""Peak HBM3e bandwidth (datasheet); the device-to-device copy measured 4,260 GB/s."""

H200_FP32_TFLOPS = 67.0
"""Peak non-tensor fp32 FMA rate: the exact tier's ceiling (IEEE dots, no tensor cores)."""

H200_FP16_TENSOR_TFLOPS = 989.0
"""Peak dense fp16 tensor-core rate with fp32 accumulation."""

FP16X3_PRODUCTS = 3
"""Tensor-core products per fp16x3 GEMM (head·head plus two corrections): its ceiling, in
fp32-equivalent FLOP/s, is the fp16 rate divided by this."""
