"""nvtp: a compiler front end that turns a single-device PyTorch transformer into a
tensor-parallel program for nvFuser."""

__version__ = "0.1.0"
