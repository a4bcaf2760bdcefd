"""DDP's gradient buckets kept between steps (``nvtp/execute/buckets.py``): each rank's backward
reduces its gradients in place in one buffer per bucket, allocated once, and hands autograd views
of it. A kept buffer must never be written while anyone still holds a view of it, so every way a
user keeps gradients between steps is run here on a dp = 2 mesh and compared with the unsharded
model trained eagerly on the whole batch (independent of nvtp): gradients accumulated over three
backwards without ``zero_grad``, ``zero_grad(set_to_none=False)``, and last step's ``p.grad`` held
while the next step runs. On simulated ranks (threads) and, slow tier, on gloo processes, where
the scheduled program also equals ``overlap=False`` bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.execute import reference, spmd
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh

CFG = gpt.config("tiny", n_layer=1)
DP = 2
MESH = DeviceMesh.of_shape((DP, 1), ("dp", "tp"))
LR = 0.1
PATTERNS = ("zero_grad", "accumulate", "keep_grads", "hold")


def _tokens(step: int, dp_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: the whole one (``dp_rank`` None) or dp rank ``dp_rank``'s rows."""
    g = torch.Generator().manual_seed(300 + step)
    idx = torch.randint(0, CFG.vocab_size, (DP * CFG.batch, CFG.seq_len), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (DP * CFG.batch, CFG.seq_len), generator=g)
    if dp_rank is None:
        return idx, targets
    mine = slice(dp_rank * CFG.batch, (dp_rank + 1) * CFG.batch)
    return idx[mine], targets[mine]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CFG)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return nvtp.full_tensor(t).detach().clone()


def _use(model: torch.nn.Module, pattern: str, dp_rank: int | None) -> dict:
    """Three steps of SGD the way ``pattern`` keeps gradients, on ``dp_rank``'s batches (None: the
    whole batch): the gradients after the last backward, the final weights, and for ``hold`` the
    gradients of the first step, held through the second (and a copy taken when they were made).

    * ``zero_grad``: ``zero_grad()`` (set to None) before each backward, the common loop;
    * ``accumulate``: three backwards without ``zero_grad``, then one ``step()``;
    * ``keep_grads``: ``zero_grad(set_to_none=False)`` before each backward;
    * ``hold``: ``g = p.grad`` of the first step kept while the second step's backward runs."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict = {}
    for step in range(3 if pattern != "hold" else 2):
        loss = model(*_tokens(step, dp_rank))
        if pattern in ("zero_grad", "hold"):
            opt.zero_grad()
        elif pattern == "keep_grads":
            opt.zero_grad(set_to_none=False)
        loss.backward()
        if pattern == "hold" and step == 0:
            out["held"] = [p.grad for p in model.parameters()]
            out["held_then"] = [_whole(g) for g in out["held"]]
        if pattern != "accumulate":
            opt.step()
    out["grads"] = [_whole(p.grad) for p in model.parameters()]
    if pattern == "accumulate":
        opt.step()
    out["params"] = [_whole(p) for p in model.parameters()]
    if "held" in out:
        out["held"] = [_whole(g) for g in out["held"]]
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check(got: dict, want: dict, pattern: str) -> None:
    """A rank's run of ``pattern`` against the unsharded model's: the same gradients and weights,
    and a held gradient unchanged by the step after it."""
    for k in ("grads", "params") + (("held",) if pattern == "hold" else ()):
        worst = max(_close(a, b) for a, b in zip(got[k], want[k]))
        assert worst <= 1e-5, (pattern, k, worst)
    if pattern == "hold":  # bit for bit what it was when the first step's backward made it
        assert all(torch.equal(a, b) for a, b in zip(got["held"], got["held_then"])), pattern


def _simulated(pattern: str, **options):
    threads = spmd.ThreadMesh(MESH, timeout=120)
    base = _model()
    ranks = [nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=MESH, comm=threads.comm(r), **options) for r in range(DP)]
    ranks[0].compile(*_tokens(0, 0))
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    got = spmd.on_threads(lambda r: _use(ranks[r], pattern, MESH.coords(r)[0]), threads)
    return got, ranks


@pytest.mark.parametrize("pattern", PATTERNS)
def test_simulated_ranks_keep_gradients_like_one_process(pattern):
    got, ranks = _simulated(pattern)
    want = _use(_model(), pattern, None)
    for r in range(DP):
        _check(got[r], want, pattern)
    buckets = reference.kept_buckets(ranks[0].last.backward.fusion, rank=0)
    assert buckets, "the dp backward's gradient bucket keeps its buffer"
    fresh = sum(b.fresh for b in buckets)
    if pattern == "zero_grad":  # nothing held between steps: the one buffer of each bucket, reused
        assert fresh == len(buckets), [b.fresh for b in buckets]
    if pattern in ("accumulate", "keep_grads"):  # the gradients held are views of the last buffer: a fresh one
        assert fresh > len(buckets), [b.fresh for b in buckets]


def test_gradients_are_views_of_the_kept_bucket():
    """After three plain steps (zero_grad, backward) each gradient the backward returns straight
    from a bucket (every parameter's but wpe's, a product of a reduced sum) is a slice of its
    rank's kept buffer: no copy back."""
    _, ranks = _simulated("zero_grad")
    program = ranks[0].last
    bwd = program.backward
    members = {n for i in program.schedules["backward"].issues for n in i.sets}
    from_bucket = {bwd.source.grad_of(s.name) for v, s in zip(bwd.fusion.outputs, bwd.source.outputs) if v.name in members}
    assert len(from_bucket) == len(list(ranks[0].module.parameters())) - 1, from_bucket
    buffers = {b.buffer.untyped_storage().data_ptr() for b in reference.kept_buckets(bwd.fusion, rank=0)}
    copies = [n for n, p in ranks[0].module.named_parameters() if n in from_bucket and p.grad.untyped_storage().data_ptr() not in buffers]
    assert not copies, f"gradients copied out of their bucket: {copies}"


def test_the_scheduled_program_equals_the_blocking_one_bit_for_bit_at_dp2():
    """Buckets reduced in place in kept buffers sum each element over the same two ranks as the
    blocking program's one all-reduce per gradient: bit for bit, over three steps."""
    plain, _ = _simulated("zero_grad", overlap=False)
    scheduled, _ = _simulated("zero_grad")
    for a, b in zip(plain, scheduled):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


def _gloo_worker(rank, world, init_method, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import _quiet_stdout, init_group

    init_group(rank, world, init_method)
    with _quiet_stdout():
        mesh = init_device_mesh("cpu", (DP, 1), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    got = {}
    for pattern in PATTERNS:
        model = nvtp.jit(_model(), plan="megatron", mesh=mesh)
        got[pattern] = _use(model, pattern, dp_rank)
        buckets = reference.kept_buckets(model.last.backward.fusion)
        got[pattern]["fresh"] = (len(buckets), sum(b.fresh for b in buckets))
    got["blocking"] = _use(nvtp.jit(_model(), plan="megatron", mesh=mesh, overlap=False), "zero_grad", dp_rank)
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_gloo_processes_keep_gradients_like_one_process(tmp_path):
    """The same on 2 gloo processes, whose all-reduces run asynchronously in the kept buffers."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "got.pt"
    assert spawn(_gloo_worker, DP, str(out)) == [0] * DP
    got = torch.load(out)
    for pattern in PATTERNS:
        _check(got[pattern], _use(_model(), pattern, None), pattern)
    (buckets, fresh), (_, after_accumulating) = got["zero_grad"]["fresh"], got["accumulate"]["fresh"]
    assert buckets and fresh == buckets and after_accumulating > buckets, (got["zero_grad"]["fresh"], got["accumulate"]["fresh"])
    assert all(torch.equal(a, b) for a, b in zip(got["blocking"]["params"], got["zero_grad"]["params"]))
