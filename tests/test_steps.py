"""What is planned is what runs: every communication a training step issues, recorded on every rank
as the rank hands it to the collective library, equals ``Program.steps()`` in order: its kind, its
mesh axis and the bytes of the buffer handed over (a bucket's concatenation, a ring's block).

The default tier runs the ranks as threads of this process and records at nvtp's thread
collectives (``ThreadComm``) and the ring's point-to-point step; the slow tier runs gloo processes
and records by wrapping ``torch.distributed``'s own functions, a pipeline's sends, receives and
broadcasts included. The first step is not compared: it also checks the ranks' batches agree
(a small all-gather that is no part of the program).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import nvtp
from nvtp.execute import collectives, ring, spmd
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh

CFG = gpt.config("tiny")


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CFG)


class Recorder:
    """Each rank's communication calls, as (kind, mesh axis, bytes handed over), from the thread
    collectives and the ring's point-to-point step, while ``active``."""

    def __init__(self, threads: spmd.ThreadMesh, monkeypatch):
        self.mine = threading.local()
        self.axis_of = {id(g): threads.mesh.names[axis] for (axis, _), g in threads.groups.items()}
        self.logs: list[list] = [[] for _ in range(threads.mesh.size)]
        self.active = False
        record = self._record

        def wrap(name, kind, nbytes):
            inner = getattr(collectives.ThreadComm, name)

            def call(comm, *args):
                record(kind, comm, nbytes(args[0]))
                return inner(comm, *args)
            monkeypatch.setattr(collectives.ThreadComm, name, call)

        wrap("all_reduce", "allreduce", lambda t: t.nbytes)
        wrap("all_gather", "allgather", lambda t: t.nbytes)
        wrap("reduce_scatter", "reduce_scatter", lambda chunks: sum(c.nbytes for c in chunks))
        shift = ring.start_shift

        def start_shift(t, comm):
            if comm.size > 1:
                record("sendrecv", comm, t.nbytes)
            return shift(t, comm)
        monkeypatch.setattr(ring, "start_shift", start_shift)

    def _record(self, kind, comm, nbytes):
        if self.active and getattr(self.mine, "log", None) is not None:
            self.mine.log.append((kind, self.axis_of[id(comm.group)], nbytes))

    def on(self, pos: int) -> None:
        self.mine.log = self.logs[pos]


def train_and_record(monkeypatch, model, mesh: DeviceMesh, plan: str, args, steps: int = 2, **options):
    """``steps`` training steps of ``nvtp.jit(model)`` on every rank of a simulated ``mesh``;
    returns (each rank's calls in the last step, the program it ran)."""
    threads = spmd.ThreadMesh(mesh, timeout=120)
    recorder = Recorder(threads, monkeypatch)
    ranks = [nvtp.jit(copy.deepcopy(model), plan=plan, mesh=mesh, comm=threads.comm(r), **options) for r in range(mesh.size)]
    ranks[0].compile(*args(0))
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ranks]

    def step(r):
        recorder.on(r)
        opts[r].zero_grad()
        out = ranks[r](*args(r))
        (out[1] if isinstance(out, tuple) else out).backward()
        opts[r].step()

    for i in range(steps):
        for log in recorder.logs:
            log.clear()
        recorder.active = i == steps - 1
        spmd.on_threads(step, threads)
    return recorder.logs, ranks[0].last


def planned(program) -> list[tuple[str, str, int]]:
    return [(s.kind, s.axis, s.payload) for s in program.steps(communication_only=True)]


def _whole(r):
    return gpt.example_tokens(CFG)


def _data(mesh):
    axis = mesh.names.index("dp")
    idx, tgt = gpt.example_tokens(CFG)

    def part(r):
        d, n = mesh.coords(r)[axis], mesh.shape[axis]
        k = idx.shape[0] // n
        return idx[d * k:(d + 1) * k], tgt[d * k:(d + 1) * k]
    return part


@pytest.mark.parametrize("case", ["tp2-megatron-sp-rings", "dp2xtp2-fsdp", "cp2xtp2"])
def test_every_communication_of_a_step_is_a_step_of_the_program(monkeypatch, case):
    if case == "tp2-megatron-sp-rings":  # buckets, and collective matmul's point-to-point steps
        mesh = DeviceMesh.of_size(2)
        logs, program = train_and_record(monkeypatch, _gpt(), mesh, "megatron-sp", _whole, collective_matmul=True)
        assert any(s.ring for s in program.steps())
    elif case == "dp2xtp2-fsdp":  # FSDP's gathers prefetched, reduce-scatters, buckets on two axes
        mesh = DeviceMesh.of_shape((2, 2), ("dp", "tp"))
        logs, program = train_and_record(monkeypatch, _gpt(), mesh, "megatron", _data(mesh), fsdp=True)
        assert {s.axis for s in program.steps(communication_only=True)} == {"dp", "tp"}
    else:  # cp's ring attention beside tp's collectives
        mesh = DeviceMesh.of_shape((2, 2), ("cp", "tp"))
        logs, program = train_and_record(monkeypatch, _gpt(), mesh, "megatron", _whole)
        assert any(s.kind == "sendrecv" for s in program.steps())
    want = planned(program)
    assert want
    for r, log in enumerate(logs):
        assert log == want, f"rank {r} ran {len(log)} communications, the program lists {len(want)}:\n{log}\n{want}"


def test_the_backend_decides_no_communication_a_program_did_not_plan(monkeypatch):
    """A program whose forward lost the step of one of its sets is refused at that set, naming it:
    the reference backend runs the program's steps, it never derives a collective for a program."""
    import dataclasses

    from nvtp import driver
    from nvtp.execute.impls import ExecutionError

    shard, dropped = driver.shard, []

    def losing_a_step(*args, **kwargs):
        program = shard(*args, **kwargs)
        dropped.append(next(iter(program.forward.set_steps)))
        steps = {k: v for k, v in program.forward.set_steps.items() if k != dropped[0]}
        return dataclasses.replace(program, forward=dataclasses.replace(program.forward, set_steps=steps))

    monkeypatch.setattr(driver, "shard", losing_a_step)
    mesh = DeviceMesh.of_size(2)
    threads = spmd.ThreadMesh(mesh, timeout=60)
    ranks = [nvtp.jit(_gpt(), plan="megatron", mesh=mesh, comm=threads.comm(r), verify=False, overlap=False) for r in range(2)]
    ranks[0].compile(*_whole(0))
    ranks[1].share_compiled(ranks[0])
    with pytest.raises(Exception) as e:
        spmd.on_threads(lambda r: ranks[r](*_whole(r)), threads)
    chain = [e.value, e.value.__cause__, e.value.__context__]
    assert any(isinstance(x, ExecutionError) and f"set {dropped[0]} " in str(x) and "planned no step for it" in str(x)
               for x in chain) or (f"set {dropped[0]} " in str(e.value) and "planned no step for it" in str(e.value)), e.value


# -- the slow tier: gloo processes, torch.distributed's own functions recorded --------------------

def _wrap_torch_distributed(log: list, axis_of) -> None:
    """Record every call to torch.distributed's collectives and point-to-point functions this
    process makes, as (kind, mesh axis, bytes handed over); a ``batch_isend_irecv`` (a ring's
    exchange) is one "sendrecv" of the tensor it sends."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    inside = [False]  # in a recorded call: what it calls inside (recv's irecv, a batch's isend and irecv) is that call

    def group_ranks(group):
        return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))

    def wrap(name, kind, nbytes, p2p=False):
        inner = getattr(c10d, name)

        def call(*args, **kwargs):
            if inside[0]:
                return inner(*args, **kwargs)
            if p2p:  # (tensor, peer)
                peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
                log.append((kind, axis_of(peer=peer), nbytes(args, kwargs)))
            else:
                log.append((kind, axis_of(ranks=group_ranks(kwargs.get("group"))), nbytes(args, kwargs)))
            inside[0] = True
            try:
                return inner(*args, **kwargs)
            finally:
                inside[0] = False
        setattr(dist, name, call)
        setattr(c10d, name, call)

    first = lambda args, kwargs: args[0].nbytes  # noqa: E731
    wrap("all_reduce", "allreduce", first)
    wrap("all_gather", "allgather", lambda args, kwargs: args[1].nbytes)
    wrap("reduce_scatter", "reduce_scatter", lambda args, kwargs: sum(t.nbytes for t in args[1]))
    wrap("broadcast", "broadcast", first)
    wrap("reduce", "reduce", first)
    wrap("isend", "send", first, p2p=True)
    wrap("send", "send", first, p2p=True)
    wrap("irecv", "recv", first, p2p=True)
    wrap("recv", "recv", first, p2p=True)
    batch = c10d.batch_isend_irecv

    def batch_isend_irecv(ops):
        sends = [op for op in ops if op.op is c10d.isend]
        op = sends[0] if sends else ops[0]
        log.append(("sendrecv", axis_of(ranks=group_ranks(op.group)), op.tensor.nbytes))
        inside[0] = True
        try:
            return batch(ops)
        finally:
            inside[0] = False
    dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv


def _steps_worker(rank, world, init_method, out, case):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group
    from nvtp.sharding.axes import spelled

    init_group(rank, world, init_method)
    names = {"tp2": ("tp",), "dp2xtp2-fsdp": ("dp", "tp"), "cp2xtp2": ("cp", "tp"), "pp2xdp2xtp2": spelled(3)}[case]
    shape = {1: (2,), 2: (2, 2), 3: (2, 2, 2)}[len(names)]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    grid = DeviceMesh.of_shape(shape, names)

    def axis_of(ranks=None, peer=None):
        for a, name in enumerate(names):
            if ranks is not None and tuple(grid.group(rank, a)) == tuple(ranks):
                return name
            if peer is not None and peer in grid.group(rank, a):
                return name
        return f"group {ranks or peer}"

    cfg = gpt.config("tiny") if len(names) < 3 else gpt.config("tiny", n_layer=4, batch=4)  # a pipeline: 2 microbatches a dp rank
    idx, tgt = gpt.example_tokens(cfg)
    torch.manual_seed(0)  # every rank builds the same model (the first call's check compares with it)
    model = gpt.GPT(cfg)
    options = {"fsdp": True} if case == "dp2xtp2-fsdp" else {"microbatches": 2} if len(names) == 3 else {}
    sm = nvtp.jit(model, plan="megatron-sp" if case == "tp2" else "megatron", mesh=mesh, **options)
    if "dp" in names:
        d, n = grid.coords(rank)[names.index("dp")], shape[names.index("dp")]
        k = idx.shape[0] // n
        idx, tgt = idx[d * k:(d + 1) * k], tgt[d * k:(d + 1) * k]
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    log: list = []
    for step in range(2):
        if step == 1:
            _wrap_torch_distributed(log, axis_of)
        opt.zero_grad()
        loss = sm(idx, tgt)
        (loss[1] if isinstance(loss, tuple) else loss).backward()
        opt.step()
    if len(names) == 3:
        want = [(s.kind, s.axis, s.payload) for s in sm.program.steps(sm.stage, communication_only=True)]
    else:
        want = planned(sm.last)
    result = {"ran": list(log), "planned": want}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2", "dp2xtp2-fsdp", "cp2xtp2", "pp2xdp2xtp2"])
def test_on_gloo_processes_every_call_to_torch_distributed_is_a_step_of_the_program(tmp_path, case):
    from nvtp.execute.launch import spawn

    world = {"tp2": 2, "pp2xdp2xtp2": 8}.get(case, 4)
    assert spawn(_steps_worker, world, str(tmp_path / "got.pt"), case) == [0] * world
    for r, g in enumerate(torch.load(tmp_path / "got.pt", weights_only=False)):
        assert g["planned"], r
        assert g["ran"] == g["planned"], f"rank {r}:\nran     {g['ran']}\nplanned {g['planned']}"
