"""nvtp: a compiler front end that turns a single-device PyTorch transformer into a
tensor-parallel program for nvFuser."""

import warnings

__version__ = "0.1.0"

# Thunder warns on import when the optional Transformer Engine is absent; nvtp never uses it.
warnings.filterwarnings("ignore", message="transformer_engine module not found")
