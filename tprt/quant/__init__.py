"""Quantized weight formats: int8 weight-only (per output channel or group-wise) and FP8 e4m3
(per output channel). `formats` holds the math (quantize, dequantize) shared by the converter and
the runtime; `methods` the linear methods that own such weights (tprt.parallel.layers)."""
