"""Quantization: int4/int8 group quantization, packing, checkpoint rewrites."""
