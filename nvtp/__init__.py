"""nvtp: a compiler front end that turns a single-device PyTorch transformer into a
tensor-parallel program for nvFuser."""

import warnings

__version__ = "0.1.0"

# Thunder warns on import when the optional Transformer Engine is absent; nvtp never uses it.
warnings.filterwarnings("ignore", message="transformer_engine module not found")


def __getattr__(name):  # keep `import nvtp` light: torch and Thunder load on first use
    if name == "jit":
        from nvtp.entry import jit  # lazy: `import nvtp` loads no torch

        return jit
    if name in ("full_tensor", "ShardedModule"):
        from nvtp import parallel  # lazy: `import nvtp` loads no torch

        return getattr(parallel, name)
    if name == "ShardingTransform":  # thunder.jit(model, transforms=[nvtp.ShardingTransform(plan, mesh)])
        from nvtp.transform import ShardingTransform  # lazy: `import nvtp` loads no torch

        return ShardingTransform
    if name == "plan":
        from nvtp.explain import plan  # lazy: `import nvtp` loads no torch

        return plan
    if name in ("save_checkpoint", "load_checkpoint"):
        from nvtp import checkpoint as _ckpt  # lazy: `import nvtp` loads no torch

        return getattr(_ckpt, name)
    raise AttributeError(f"module 'nvtp' has no attribute {name!r}")
