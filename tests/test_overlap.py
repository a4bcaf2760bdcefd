"""Communication scheduling (nvtp/sharding/overlap.py): collectives start as soon as their inputs
exist, small ones of one kind and axis go as one, FSDP's gathers are prefetched a bucket ahead;
and the scheduled program computes exactly what the unscheduled one computes.

The schedule's invariants are checked on the programs nvtp.jit compiles (nvtp's GPT, 1-D and a
(2, 2) mesh with FSDP and DDP); equality bit for bit against ``overlap=False`` on simulated ranks
(threads) and, slow tier, on gloo processes whose collectives really run asynchronously.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp import driver
from nvtp.execute import spmd
from nvtp.models import gpt
from nvtp.sharding.overlap import schedule_collectives
from nvtp.sharding.placements import DeviceMesh

CFG = gpt.config("tiny")
MESH_2X2 = DeviceMesh.of_shape((2, 2), ("dp", "tp"))


def _gpt():
    torch.manual_seed(0)
    return gpt.GPT(CFG)


def _program(mesh, fsdp=False, plan="megatron"):
    idx, tgt = gpt.example_tokens(CFG)
    if mesh.ndim > 1:
        idx, tgt = idx[:1], tgt[:1]
    return driver.compile(_gpt(), idx, tgt, plan=plan, mesh=mesh, fsdp=fsdp)


@pytest.fixture(scope="module")
def programs():
    return {"tp4": _program(DeviceMesh.of_size(4), plan="megatron-sp"), "fsdp": _program(MESH_2X2, fsdp=True),
            "ddp": _program(MESH_2X2)}


def _check_schedule(sharded, schedule, bucket_bytes):
    f = sharded.fusion
    index = {v.name: i for i, op in enumerate(f.ops) for v in op.outputs}
    inputs = {v.name for v in f.inputs}
    ops = {op.outputs[0].name: op for op in f.ops if op.kind == "set" and op.outputs}
    planned = sorted(n for n, s in sharded.set_steps.items() if s.is_communication)
    started = sorted(n for i in schedule.issues for n in i.sets)
    assert started == planned  # every collective scheduled, once
    for issue in schedule.issues:
        steps = [sharded.set_steps[n] for n in issue.sets]
        assert len({(s.axis, s.kind, ops[n].outputs[0].dtype) for n, s in zip(issue.sets, steps)}) == 1
        for name, wait in zip(issue.sets, issue.waits):
            operand = ops[name].operands[0].name
            ready = -1 if operand in inputs else index[operand]
            assert ready <= issue.at < wait == index[name], (issue, name)  # after its input exists, before it is needed
        if len(issue.sets) > 1:
            assert sum(s.tensor_bytes for s in steps) <= bucket_bytes
        assert issue.bytes == sum(s.bytes for s in steps)


@pytest.mark.parametrize("case", ["tp4", "fsdp", "ddp"])
def test_every_collective_starts_after_its_input_and_before_it_is_needed(programs, case):
    program = programs[case]
    for phase, sharded in program.phases():
        _check_schedule(sharded, program.schedules[phase], program.schedules[phase].bucket_bytes)
        small = schedule_collectives(sharded, bucket_bytes=1)  # no buckets: one collective each
        _check_schedule(sharded, small, 1)
        assert all(len(i.sets) == 1 for i in small.issues)


def test_gradient_reductions_go_in_buckets_and_start_during_the_backward(programs):
    program = programs["ddp"]
    dp = program.mesh.names.index("dp")
    steps = [s for s in program.backward.set_steps.values() if s.is_communication and s.axis == dp and s.kind == "allreduce"]
    grads = [i for i in program.schedules["backward"].issues if i.axis == dp and i.kind == "allreduce"]
    assert len(steps) >= 10 and len(grads) < len(steps) / 3  # many small gradient all-reduces, few collectives
    # Buckets of 16 KiB (the tiny model's gradients are 0.3 MiB): the first starts early in the backward.
    small = [i for i in schedule_collectives(program.backward, bucket_bytes=16 << 10).issues if i.axis == dp and i.kind == "allreduce"]
    last = len(program.backward.fusion.ops) - 1
    assert len(small) > 2 and min(i.at for i in small) < 0.6 * last  # while more than 40% of the backward is still to run


def test_fsdp_gathers_are_prefetched_one_bucket_ahead(programs):
    program = programs["fsdp"]
    dp = program.mesh.names.index("dp")
    for phase, sharded in program.phases():
        inputs = {v.name for v in sharded.fusion.inputs}
        ops = {op.outputs[0].name: op for op in sharded.fusion.ops if op.kind == "set" and op.outputs}
        gathers = [i for i in program.schedules[phase].issues
                   if i.axis == dp and i.kind == "allgather" and ops[i.sets[0]].operands[0].name in inputs]
        assert gathers and gathers[0].at == -1
        for before, after in zip(gathers, gathers[1:]):  # each starts where the one before is first waited for
            assert after.at == min(before.waits)


def _run(model, mesh, args, steps=2, **options):
    """``steps`` SGD steps of megatron-sp on simulated ranks, ``nvtp.jit(..., **options)``: every
    rank's losses, every rank's parameters, and rank 0's program."""
    threads = spmd.ThreadMesh(mesh, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron-sp", mesh=mesh, comm=threads.comm(r), **options)
             for r in range(mesh.size)]
    ranks[0].compile(*args)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ranks]

    def train(r):
        losses = []
        for _ in range(steps):
            loss = ranks[r](*args)
            opts[r].zero_grad()
            loss.backward()
            opts[r].step()
            losses.append(loss.detach())
        return losses

    losses = spmd.on_threads(train, threads)
    return losses, [[p.detach().clone() for p in m.module.parameters()] for m in ranks], ranks[0].last


@pytest.mark.parametrize("mesh, fsdp", [(DeviceMesh.of_size(4), False), pytest.param(MESH_2X2, True, marks=pytest.mark.slow)],
                         ids=["tp4", "fsdp2x2"])  # fsdp2x2: 15 s; test_steps runs FSDP scheduled
def test_the_scheduled_program_computes_the_unscheduled_ones_results_bit_for_bit(mesh, fsdp):
    idx, tgt = gpt.example_tokens(CFG)
    args = (idx, tgt) if mesh.ndim == 1 else (idx[:1], tgt[:1])
    model = _gpt()
    plain = _run(model, mesh, args, overlap=False, fsdp=fsdp)
    scheduled = _run(model, mesh, args, overlap=True, fsdp=fsdp)
    assert not plain[2].schedules and scheduled[2].schedules
    assert len(scheduled[2].collectives()) < len(plain[2].collectives())  # buckets: fewer collectives, the same tensors
    for a, b in zip(plain[0], scheduled[0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(plain[1], scheduled[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _gloo_worker(rank, world, init_method, out, overlap):
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import _quiet_stdout, init_group

    init_group(rank, world, init_method)
    with _quiet_stdout():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nvtp.jit(_gpt(), plan="megatron", mesh=mesh, fsdp=True, overlap=overlap)
    idx, tgt = gpt.example_tokens(CFG)
    dp = mesh.get_local_rank("dp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(idx[dp:dp + 1], tgt[dp:dp + 1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    whole = [nvtp.full_tensor(p) for p in model.parameters()]
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "issued": len(model.last.collectives())}, out)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_on_gloo_processes_the_asynchronous_program_computes_the_same(tmp_path):
    """2 x 2 gloo processes, FSDP: collectives started with async_op=True and waited for later
    give the blocking program's losses and weights, bit for bit."""
    from nvtp.execute.launch import spawn

    got = {}
    for overlap in (False, True):
        out = tmp_path / f"{overlap}.pt"
        assert spawn(_gloo_worker, 4, str(out), overlap) == [0, 0, 0, 0]
        got[overlap] = torch.load(out)
    assert got[True]["issued"] < got[False]["issued"]
    assert all(torch.equal(a, b) for a, b in zip(got[False]["losses"], got[True]["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(got[False]["params"], got[True]["params"]))


# ---------------------------------------------------------------------------------------------
# collective matmul: Megatron-SP's gathers before, and reduce-scatters after, the projections as ring steps


def _train_ring(mesh, collective_matmul, args, steps=2):
    """``_run`` with ``collective_matmul``: (rank 0's losses, rank 0's parameters, the program,
    the point-to-point steps a rank sent per step, every step every rank sent)."""
    from nvtp.execute import ring

    with ring.recording() as sent:  # verify=False: the first call's check (nvtp/guard.py) runs the program once more
        losses, params, program = _run(_gpt(), mesh, args, steps, collective_matmul=collective_matmul, verify=False)
    return losses[0], params[0], program, len(sent) // (mesh.size * steps), sent


@pytest.mark.parametrize("mesh", [DeviceMesh.of_size(4), pytest.param(MESH_2X2, marks=pytest.mark.slow)], ids=["tp4", "dp2xtp2"])  # dp2xtp2: 14 s
def test_collective_matmul_computes_what_the_collectives_compute(mesh):
    """Every gather before a projection and reduce-scatter after one, run as ring steps
    (collective_matmul=True), trains as the program with the collectives does, within rounding
    (the blocks are summed in another order); the steps sent are the plan's, byte for byte."""
    idx, tgt = gpt.example_tokens(CFG)
    args = (idx, tgt) if mesh.ndim == 1 else (idx[:1], tgt[:1])
    plain = _train_ring(mesh, False, args)
    ringed = _train_ring(mesh, True, args)
    forward, backward = ringed[2].schedules["forward"].rings, ringed[2].schedules["backward"].rings
    rings = forward + backward
    assert {r.kind for r in forward} == {"allgather-linear", "linear-reducescatter"}
    assert len(forward) == 4 * CFG.n_layer + 1  # 4 a layer (2 gathers, 2 reduce-scatters), and the head's gather
    # The backward's gathers before the products by the weights (reshape -> matmul -> reshape); its
    # reduce-scatters stay collectives (the partial sums feed a sum too).
    assert {r.kind for r in backward} == {"allgather-linear"} and len(backward) == 2 * CFG.n_layer
    assert all(len(c) == 3 for r in backward for c in r.chains)
    assert not plain[2].schedules["forward"].rings and plain[3] == 0
    for a, b in zip(plain[0], ringed[0]):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    for p, q in zip(plain[1], ringed[1]):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    planned = [(c["tensors"][0], c["bytes"]) for c in ringed[2].collectives() if c["kind"] == "sendrecv"]
    n = mesh.shape[mesh.names.index("tp")] if mesh.ndim > 1 else mesh.size
    assert len(planned) == len(rings) * (n - 1) == ringed[3]
    assert sorted(ringed[4][:len(planned) * mesh.size]) == sorted(planned * mesh.size)
    ring_sets = {r.name for r in rings}  # none of them runs as a collective any more
    assert not any(set(i.sets) & ring_sets for phase in ("forward", "backward") for i in ringed[2].schedules[phase].issues)


def test_the_cost_model_takes_a_ring_where_it_pays():
    """On the H100 machine model a GPT-3 layer's projections pay as rings; on this CPU's gloo
    model the tiny GPT's (a few KiB a step, 0.5 ms a step) do not, so "auto" leaves them."""
    from nvtp.sharding.collective_matmul import find_rings, plan_rings
    from nvtp.sharding.cost import MACHINES, ring_seconds

    program = _program(DeviceMesh.of_size(4), plan="megatron-sp")
    candidates = find_rings(program.forward)
    assert len(candidates) == 4 * CFG.n_layer + 1
    assert plan_rings(program.forward, MACHINES["cpu-gloo"], "auto") == []
    assert len(plan_rings(program.forward, MACHINES["cpu-gloo"], True)) == len(candidates)
    assert plan_rings(program.forward, MACHINES["cpu-gloo"], False) == []
    blocking, ringed = ring_seconds(program.forward, candidates[0], MACHINES["cpu-gloo"])
    assert ringed > blocking  # three 0.5 ms steps for microseconds of matmul

    big = gpt.config("gpt3")
    from nvtp import explain

    report = explain.explain_gpt(big, layers=1, plan="megatron-sp", devices=8, machine="h100-nvlink")
    block = report.regions[-1]
    assert len(block.schedules["forward"].rings) == 4  # q|k|v and fc in: gathers; attention out and fc out: reduce-scatters
    for r in block.schedules["forward"].rings:
        blocking, ringed = ring_seconds(block.forward, r, MACHINES["h100-nvlink"])
        assert ringed < blocking and "h100-nvlink" in r.why
    summary = report.schedule_summary()["forward"]
    assert summary["hidden"] > 0.5  # the forward's gathers and reduce-scatters hide behind the projections
    assert "collective matmuls" in report.as_text()


def test_collective_matmul_is_refused_when_misspelt():
    with pytest.raises(nvtp.errors.InputError, match="collective_matmul"):
        nvtp.jit(_gpt(), plan="megatron-sp", mesh=DeviceMesh.of_size(2), comm=spmd.ThreadMesh(DeviceMesh.of_size(2)).comm(0),
                 collective_matmul="yes")


def _gloo_ring_worker(rank, world, init_method, out, collective_matmul):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import _quiet_stdout, init_group

    init_group(rank, world, init_method)
    with _quiet_stdout():
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = nvtp.jit(_gpt(), plan="megatron-sp", mesh=mesh, collective_matmul=collective_matmul)
    idx, tgt = gpt.example_tokens(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    whole = [nvtp.full_tensor(p) for p in model.parameters()]
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "rings": len(model.last.schedules["forward"].rings)}, out)
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_on_gloo_processes_collective_matmul_trains_like_the_collectives(tmp_path):
    """2 gloo processes, megatron-sp: the ring steps (batch_isend_irecv started before each
    block's matmul, waited for after it) train as the all-gathers and reduce-scatters do."""
    from nvtp.execute.launch import spawn

    got = {}
    for on in (False, True):
        out = tmp_path / f"{on}.pt"
        assert spawn(_gloo_ring_worker, 2, str(out), on) == [0, 0]
        got[on] = torch.load(out)
    assert got[False]["rings"] == 0 and got[True]["rings"] == 4 * CFG.n_layer + 1
    for a, b in zip(got[False]["losses"], got[True]["losses"]):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    for p, q in zip(got[False]["params"], got[True]["params"]):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_collective_matmuls_print_as_nvfusers_stream_parallel_schedule_and_build(tmp_path):
    """``write_nvfuser`` of a program with collective matmuls adds, per phase and kind, the
    product as nvFuser's own overlap tests write it: the gathered input split over devices and
    the product's rows over streams (``ParallelType.stream``); for a reduce-scatter the
    contraction split over devices and the set after it reduce-scattering. nvfuser_direct builds
    each from its text, and nvtp reads back the device placements (streams are no placement)."""
    from nvtp.execute.nvfuser import build_from_text
    from nvtp.ir.parser import parse
    from nvtp.sharding.placements import Partial, Replicate, Shard
    from nvtp.sharding.schedule import shardings_from_schedule

    idx, tgt = gpt.example_tokens(CFG)
    program = driver.compile(_gpt(), idx, tgt, plan="megatron-sp", mesh=4, backend="nvfuser", collective_matmul=True)
    paths = program.write_nvfuser(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["program_bwd.py", "program_bwd_collective_matmul_allgather.py", "program_fwd.py",
                     "program_fwd_collective_matmul_allgather.py", "program_fwd_collective_matmul_reducescatter.py"]
    for path in paths:
        text = path.read_text()
        build_from_text(text, str(path))
        if "collective_matmul" not in path.name:
            continue
        assert "parallelize(ParallelType.stream)" in text
        dump = parse(text, str(path))
        f = dump.fusion
        shardings, _ = shardings_from_schedule(f, dump.schedule)
        x, out = f.inputs[0].name, f.outputs[0].name
        assert shardings[x] == ((Shard(1),) if "allgather" in path.name else (Shard(2),))
        if "allgather" in path.name:  # whole rows (the streams are no placement): the column-parallel features split, if any
            assert shardings[out] in ((Shard(2),), (Replicate(),))
        else:  # the rows reduce-scattered
            assert shardings[out] == (Shard(1),)
        if "reducescatter" in path.name:
            assert any(s == (Partial("sum"),) for s in shardings.values())
    no_rings = driver.compile(_gpt(), idx, tgt, plan="megatron-sp", mesh=4, backend="nvfuser", collective_matmul=False)
    assert len(no_rings.write_nvfuser(tmp_path / "plain")) == 2


def test_explain_lists_and_prices_the_rings_as_typed():
    """``nvtp explain --plan megatron-sp --collective-matmul on --machine ...``, as typed: the rings
    per phase and the estimate with them; ``off`` the program without."""
    from tests.test_cli import run

    typed = ["nvtp", "explain", "--model", "nanogpt", "--config", "tiny", "--plan", "megatron-sp", "--devices", "4", "--machine", "h100-nvlink"]
    on = run(typed + ["--collective-matmul", "on"])
    assert on.returncode == 0, on.stderr
    assert "forward collective matmuls (ring steps, each beside a block of the matmul): " in on.stdout
    assert "allgather-linear in" in on.stdout and "linear-reducescatter in" in on.stdout
    off = run(typed + ["--collective-matmul", "off"])
    assert off.returncode == 0 and "collective matmuls" not in off.stdout
    bad = run(typed + ["--collective-matmul", "maybe"])
    assert bad.returncode != 0 and "--collective-matmul" in bad.stderr
