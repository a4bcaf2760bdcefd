"""FSDP holds the weights of about one block at a time, as FSDP2 does (issue 37, memory).

A rank's FSDP step gathers each weight in the forward and again in the backward
(``nvtp.sharding.overlap``: buckets of one block's consecutive uses, each started where the one
before is first waited for). Counted here, on simulated ranks: every tensor the step's all-gathers
make (each rank's part of a bucket, and each weight made whole from them) from the moment it is
made to the moment it is freed. The most of them alive at once must not grow with the model's
depth, and must stay within two blocks' weights and one more weight: the block running and the
one prefetched. It grew with the depth when one bucket of 25 MiB held every weight of the step
(docs/benchmarks.md, "Against PyTorch's plans, compiled and not"). The schedule behind it is
checked too: each FSDP bucket one block's, each weight-gradient reduce-scatter done where the next
starts. The training itself must be one process's on the whole batch.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import replace

import pytest
import torch

import nvtp
from nvtp.execute import collectives, spmd
from nvtp.models import gpt
from nvtp.sharding.overlap import block_of
from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.report import weight_of

DP = 2
CFG = replace(gpt.config("tiny"), batch=2)  # hidden 64, 4 heads, sequence 16, vocabulary 256; batch 2 a rank


class Gathered:
    """The bytes of the tensors all-gathers made that are still alive, per rank thread, and the most at once."""

    def __init__(self, monkeypatch):
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}
        self.most: dict[int, int] = {}
        all_gather, joined = collectives.ThreadComm.all_gather, collectives.joined

        def gathering(comm, t):
            parts = all_gather(comm, t)
            for p in parts:
                self.made(p)
            return parts

        def joining(*args, **kwargs):
            return self.made(joined(*args, **kwargs))

        monkeypatch.setattr(collectives.ThreadComm, "all_gather", gathering)
        monkeypatch.setattr(collectives, "joined", joining)

    def made(self, t: torch.Tensor) -> torch.Tensor:
        me, n = threading.get_ident(), t.untyped_storage().nbytes()
        with self.lock:
            self.live[me] = self.live.get(me, 0) + n
            self.most[me] = max(self.most.get(me, 0), self.live[me])
        weakref.finalize(t, self.freed, me, n)  # when the tensor and every view of it are gone
        return t

    def freed(self, me: int, n: int) -> None:
        with self.lock:
            self.live[me] -= n


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, CFG.vocab_size, (DP * CFG.batch, CFG.seq_len), generator=g)
    return idx, torch.randint(0, CFG.vocab_size, (DP * CFG.batch, CFG.seq_len), generator=g)


def _mine(batch, rank: int):
    return tuple(t[rank * CFG.batch:(rank + 1) * CFG.batch] for t in batch)


def _step(model, batch, opt) -> torch.Tensor:
    loss = model(*batch)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _fsdp_step(layers: int, monkeypatch) -> tuple[int, list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """One SGD step of nvtp's GPT with ``layers`` blocks, FSDP on dp = 2 simulated ranks: the most
    gathered bytes a rank held at once, the ranks' losses, the whole weights after the step, and the model."""
    torch.manual_seed(0)
    base = gpt.GPT(replace(CFG, n_layer=layers))
    mesh = DeviceMesh.of_shape((DP,), ("dp",))
    threads = spmd.ThreadMesh(mesh, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh, comm=threads.comm(r), fsdp=True) for r in range(DP)]
    ranks[0].compile(*_mine(_tokens(0), 0))
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ranks]
    gathered = Gathered(monkeypatch)
    losses = spmd.on_threads(lambda r: float(_step(ranks[r], _mine(_tokens(0), r), opts[r])), threads)
    params = {}
    for name, p in base.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        params[name] = spmd.assemble(parts, ranks[0].placement(name), p.shape, mesh)
    _check_schedule(ranks[0].last)
    return max(gathered.most.values()), losses, params, base


def _check_schedule(program) -> None:
    """Each FSDP bucket moves one block's weights (or the model's own: ``block_of`` ""), and a
    reduce-scatter of weight gradients is waited for where the next one starts."""
    for phase, sharded in program.phases():
        reduce_scatters = []
        for issue in program.schedules[phase].issues:
            labels = {weight_of(sharded, name, sharded.set_steps[name]) for name in issue.sets}
            if issue.kind in ("allgather", "reduce_scatter") and all(labels):
                assert len({block_of(label) for label in labels}) == 1, (phase, issue.at, sorted(labels))
                if issue.kind == "reduce_scatter":
                    reduce_scatters.append(issue)
        for before, after in zip(reduce_scatters, reduce_scatters[1:]):
            assert before.done == after.at, (phase, before, after)


def _eager(base: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(base)
    loss = _step(model, _tokens(0), torch.optim.SGD(model.parameters(), lr=0.1))
    return float(loss), {n: p.detach() for n, p in model.named_parameters()}


def _bytes(model: torch.nn.Module, prefix: str = "") -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefix))


@pytest.mark.parametrize("layers", [8])
def test_fsdp_holds_one_block_of_gathered_weights_and_the_next_not_the_whole_model(layers, monkeypatch):
    shallow, *_ = _fsdp_step(2, monkeypatch)
    deep, losses, params, base = _fsdp_step(layers, monkeypatch)
    block = _bytes(base, "h.0.")
    assert deep <= 2.5 * block, (f"a rank held {deep} bytes of gathered weights at once: more than 2.5 blocks ({block} B each); "
                                 f"the model's weights are {_bytes(base)} B")
    assert deep <= shallow * 1.05, f"the gathered weights alive at once grow with the depth: {shallow} B at 2 blocks, {deep} B at {layers}"
    want_loss, want = _eager(base)  # the same step, one process on the whole batch
    assert abs(sum(losses) / DP - want_loss) <= 1e-5 * abs(want_loss), (losses, want_loss)
    for name, w in want.items():
        assert float((params[name] - w).norm() / w.norm()) <= 1e-5, name
