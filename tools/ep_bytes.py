"""All-to-all bytes of nvtp's expert parallelism against the analytical volume (docs/moe.md).

    .venv/bin/python tools/ep_bytes.py              # the benchmark's config: batch 8 x 32, ep=2
    .venv/bin/python tools/ep_bytes.py 4            # ep=4
    .venv/bin/python tools/ep_bytes.py 2 deepseek_v3    # transformers' DeepSeek-V3 (tests/test_ep.py's tiny config)
    .venv/bin/python tools/ep_bytes.py 2 qwen2_moe      # or qwen3_moe, olmoe, gpt_oss (tests/test_ep.py: _hf_moe)

nvtp's MoE GPT (``benchmarks/ep_worker.py``'s config: hidden 64, 4 experts, top-2, expert width
128, 2 layers, fp32, batch 8 x 32) on simulated ranks (threads of one process; the bytes are those
of gloo processes, which ``tests/test_ep.py``'s slow tier checks): one training step after the
first (whose call also runs nvtp.jit's first-call check), the bytes each rank sent by all-to-all
(``nvtp.execute.ep.recording()``), against its Program's steps and against the analytical volume:
per MoE layer and pass (forward, backward) one dispatch and one combine of a rank's routed rows
routed uniformly ((P-1)/P of them leave the rank), each ``n_embd`` wide. No timing.
With a transformers family (``deepseek_v3``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``, ``gpt_oss``): its
tiny build of ``tests/test_ep.py: _hf_moe`` (hidden 64, 4 routed experts, top-2, 2 MoE layers,
batch 4 x 8), the same count.
"""

from __future__ import annotations

import collections
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvtp  # noqa: E402
from nvtp.execute import ep as ep_run  # noqa: E402
from nvtp.execute import spmd  # noqa: E402
from nvtp.models import moe  # noqa: E402
from nvtp.sharding.placements import DeviceMesh  # noqa: E402


def _model(family: str, ep: int):
    """(model, batch, its loss of a call, a description, MoE layers, a rank's routed rows a layer, hidden)."""
    if family != "moe_gpt":
        from nvtp.frontend.moe import is_transformers_experts
        from tests.test_ep import _hf_moe

        model, ids = _hf_moe(family)
        c = model.config
        rows = ids.numel() // ep * c.num_experts_per_tok
        experts = [m for m in model.modules() if is_transformers_experts(m)]
        layers = len(experts)
        what = (f"{type(model).__name__} batch {ids.shape[0]} x {ids.shape[1]}, {experts[0].num_experts} routed experts, "
                f"top-{c.num_experts_per_tok}, {layers} MoE layers, ep={ep}")
        return model, (ids,), lambda m: m(ids, labels=ids).loss, what, layers, rows, c.hidden_size
    cfg = moe.config("tiny", batch=8, seq_len=32)
    what = f"MoE GPT batch {cfg.batch} x {cfg.seq_len}, {cfg.n_expert} experts, top-{cfg.top_k}, {cfg.n_layer} layers, ep={ep}"
    batch = moe.example_tokens(cfg, seed=0)
    rows = cfg.batch // ep * cfg.seq_len * cfg.top_k
    return moe.MoEGPT(cfg), batch, lambda m: m(*batch), what, cfg.n_layer, rows, cfg.n_embd


def main(argv: list[str]) -> None:
    ep = int(argv[0]) if argv else 2
    family = argv[1] if len(argv) > 1 else "moe_gpt"
    model, batch, loss_of, what, layers, rows, hidden = _model(family, ep)
    mesh = DeviceMesh.of_shape((ep,), ("ep",))
    threads = spmd.ThreadMesh(mesh, timeout=600)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r)) for r in range(ep)]
    ranks[0].compile(*batch)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])

    def step(r):
        loss_of(ranks[r]).backward()

    spmd.on_threads(step, threads)
    with ep_run.recording() as sent:
        spmd.on_threads(step, threads)
    steps = [s for s in ranks[0].last.steps() if s.kind == "alltoall"]
    planned = sum(s.bytes for s in steps)
    per_rank = sum(b for _, b in sent) // ep
    analytical = layers * 2 * 2 * rows * (ep - 1) // ep * hidden * 4
    kinds = collections.Counter()
    for s in steps:
        kinds[(s.phase, s.tensor, s.shape)] += 1
    print(what)
    for (phase, part, shape), k in kinds.items():
        print(f"  {phase:8} {k} x {part:8} {list(shape)}")
    print(f"all-to-all bytes per rank per step: sent {per_rank}, Program.steps() {planned} ({'equal' if per_rank == planned else 'DIFFER'}), "
          f"analytical {analytical}: {per_rank / analytical:.2f} x")


if __name__ == "__main__":
    main(sys.argv[1:])
