"""Time nvtp's GPT-2 block (forward + backward, bf16, batch 1 x 1024) in eager PyTorch on this GPU."""
import torch
from nvtp.models import gpt
cfg = gpt.config("gpt2", dropout=0.0)
torch.manual_seed(0)
block = gpt.Block(cfg).cuda().to(torch.bfloat16)
x = torch.randn(cfg.batch, cfg.seq_len, cfg.n_embd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
def step():
    y = block(x); y.backward(torch.ones_like(y))
for _ in range(5): step()
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
ev[0].record()
for _ in range(50): step()
ev[1].record(); torch.cuda.synchronize()
print(f"EAGER gpt2 block fwd+bwd bf16: {ev[0].elapsed_time(ev[1]) / 50:.3f} ms per step (mean of 50 after 5 warm-ups)")
