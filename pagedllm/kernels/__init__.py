"""Kernels: paged attention (attention/), and the compiled CPU kernels by family: build.py
builds and loads them, linear.py (dense and quantized matmuls), elementwise.py (norms,
rotary, activations) and sampling.py wrap them."""
