"""``nvtp demo``: the main job, end to end on this machine."""

from __future__ import annotations

import time

import torch


def main(args) -> int:
    from nvtp.dump import relative_error
    from nvtp.execute import reference
    from nvtp.frontend.capture import capture, output_value, run_pair
    from nvtp.models import gpt

    cfg = gpt.config(args.config)
    torch.manual_seed(0)
    block = gpt.Block(cfg)
    x = gpt.example_input(cfg)
    print(f"nvtp demo: GPT block '{args.config}' (b={cfg.batch}, s={cfg.seq_len}, e={cfg.n_embd}, heads={cfg.n_head}), fp32")
    start = time.perf_counter()
    c = capture(block, x)
    print(f"  traced with Thunder in {time.perf_counter() - start:.1f} s: forward fusion {len(list(c.forward.compute_ops()))} ops, "
          f"backward fusion {len(list(c.backward.compute_ops()))} ops")
    named = {n: p.detach() for n, p in block.named_parameters()} | {"x": x.detach()}
    g = torch.randn(cfg.batch, cfg.seq_len, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    values, grads = run_pair(c.forward, c.backward, named, g, lambda f, i: reference.run(f, i))
    x_ref = x.detach().clone().requires_grad_()
    y_ref = block(x_ref)
    y_ref.backward(g)
    worst = relative_error(values[output_value(c.forward)], y_ref)[0]
    for name, p in [("x", x_ref)] + list(block.named_parameters()):
        worst = max(worst, relative_error(grads[f"grad({name})"], p.grad)[0])
    ok = worst <= 1e-5
    print(f"  reference backend vs eager PyTorch: worst relative error {worst:.2e} over the output and 13 gradients "
          f"({'ok' if ok else 'FAIL'}, tolerance 1e-5)")
    return 0 if ok else 1
