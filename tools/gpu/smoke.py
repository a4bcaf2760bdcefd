import torch
import nvfuser_direct as nvf
from nvfuser_direct import FusionDefinition, DataType
print("nvfuser_direct", getattr(nvf, "__version__", "?"), "torch", torch.__version__)
with FusionDefinition() as fd:
    a = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
    b = fd.ops.relu(fd.ops.mul(a, a))
    fd.add_output(b)
x = torch.randn(4, 8, device="cuda")
out = fd.execute([x])
print("smoke max err", (out[0] - torch.relu(x * x)).abs().max().item())
