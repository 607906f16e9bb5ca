"""kvwatch: finds streaming clients that pin KV cache in GPU memory, and frees it."""

__version__ = "0.1.0"
