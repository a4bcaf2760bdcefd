"""The sharding compiler: plans from the graph, propagation both ways, Megatron's communication
exactly, and sharded runs (ranks simulated as threads) equal to the single-device run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nvtp import cli, dump
from nvtp.execute import reference, spmd
from nvtp.sharding.reshard import COLLECTIVES
from nvtp.frontend.capture import capture
from nvtp.ir.build import FusionBuilder
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import ValueInfo
from nvtp.sharding.passes import shard, shard_pair
from nvtp.sharding.placements import DeviceMesh, Partial, Replicate, Shard, _StridedShard, is_partial, local_shape
from nvtp.sharding.propagate import ShardingError, propagate_shardings
from tests.blocks import BLOCKS

ROOT = Path(__file__).resolve().parents[1]
GPT3_FWD, GPT3_BWD = ROOT / "fusions/nanogpt_gpt3_bf16_fwd.py", ROOT / "fusions/nanogpt_gpt3_bf16_bwd.py"


@pytest.fixture(scope="module")
def gpt3():
    return dump.load(GPT3_FWD).fusion, dump.load(GPT3_BWD).fusion


def by_label(fusion, sharded):
    return {fusion.label(v.name): sharded.placement(v.name) for v in fusion.inputs}


def kinds(sharded):
    return [c.kind for c in sharded.communications]


# -- plans ------------------------------------------------------------------------------------


def test_megatron_plan_comes_from_the_graph(gpt3):
    fwd, _ = gpt3
    s = shard(fwd, "megatron", DeviceMesh.of_size(4))
    placed = by_label(fwd, s)
    assert placed["attn.c_attn.weight"] == _StridedShard(0, split_factor=3)  # fused q, k, v
    assert placed["attn.c_attn.bias"] == _StridedShard(0, split_factor=3)
    assert placed["mlp.c_fc.weight"] == Shard(0) and placed["mlp.c_fc.bias"] == Shard(0)
    assert placed["attn.c_proj.weight"] == Shard(1) and placed["mlp.c_proj.weight"] == Shard(1)
    assert placed["attn.c_proj.bias"] == Replicate() and placed["ln_1.weight"] == Replicate()
    assert placed["x"] == Replicate()


def test_sequence_parallel_splits_activations_along_the_sequence(gpt3):
    fwd, _ = gpt3
    s = shard(fwd, "megatron-sp", DeviceMesh.of_size(4))
    assert by_label(fwd, s)["x"] == Shard(1)


def test_weights_hold_one_dth_of_their_bytes_per_rank(gpt3):
    fwd, _ = gpt3
    for d in (2, 4):
        s = shard(fwd, "megatron", DeviceMesh.of_size(d))
        for v in fwd.inputs:
            if fwd.label(v.name).endswith("weight") and v.ndim == 2:
                per_rank = torch.Size(local_shape(v.shape, s.shardings[v.name], s.mesh)).numel() * v.dtype.itemsize
                assert per_rank * d == v.nbytes, fwd.label(v.name)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_other_blocks_pair_their_projections(name):
    torch.manual_seed(0)
    block = BLOCKS[name]()
    c = capture(block, torch.randn(2, 16, 64, requires_grad=True))
    s = shard(c.forward, "megatron", DeviceMesh.of_size(4))
    row = {n for n in s.annotations.row}
    column = {n for n in s.annotations.column}
    expected = {
        "llama_gqa": ({"q.weight", "k.weight", "v.weight", "gate.weight", "up.weight"}, {"o.weight", "down.weight"}),
        "llama_gqa_bias": ({"q.weight", "k.weight", "v.weight", "gate.weight", "up.weight"}, {"o.weight", "down.weight"}),
        "separate_qkv": ({"q.weight", "k.weight", "v.weight", "fc.weight"}, {"proj.weight", "fc_proj.weight"}),
        "parallel_residual": ({"qkv.weight", "fc.weight"}, {"out.weight", "proj.weight"}),
    }[name]
    assert (column, row) == expected


@pytest.mark.parametrize("placement", [Shard(1), Partial("sum")])
def test_assemble_builds_the_whole_tensor_on_the_parts_device(placement):
    """The parts' device, not the CPU: the first-call check gathers CUDA parameters through it (a
    GPU run of nvtp.jit(backend="nvfuser") failed on a CPU whole; docs/gpu.md 2026-11-27). Meta
    parts stand in for a device the CPU suite does not have."""
    whole = torch.arange(24.0).reshape(4, 6)
    mesh = DeviceMesh.of_size(2)
    parts = [spmd.shard_tensor(whole, placement, mesh, r) for r in range(2)]
    assert torch.equal(spmd.assemble(parts, placement, whole.shape, mesh), whole)
    out = spmd.assemble([p.to("meta") for p in parts], placement, whole.shape, mesh)
    assert out.device.type == "meta" and tuple(out.shape) == (4, 6)


def test_explicit_plans_take_globs_placements_and_torch_styles(tiny_capture):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    f = tiny_capture.forward
    mesh = DeviceMesh.of_size(2)
    plan = {"attn.c_attn": ColwiseParallel(), "*.c_proj": RowwiseParallel(), "mlp.c_fc.weight": "colwise", "mlp.c_fc.bias": Shard(0)}
    s = shard(f, plan, mesh)
    placed = by_label(f, s)
    # ColwiseParallel on a fused projection splits each of q, k, v: what PyTorch's own plan cannot do.
    assert placed["attn.c_attn.weight"] == _StridedShard(0, split_factor=3)
    assert placed["attn.c_proj.weight"] == Shard(1) and placed["attn.c_proj.bias"] == Replicate()
    assert placed["mlp.c_fc.weight"] == Shard(0) and placed["mlp.c_fc.bias"] == Shard(0)
    assert kinds(s) == ["allreduce", "allreduce"]
    text = shard(f, "attn.c_attn.weight=S(0,3);attn.c_attn.bias=S(0,3);attn.c_proj.weight=S(1)", mesh)
    assert by_label(f, text)["attn.c_attn.weight"] == _StridedShard(0, split_factor=3)


def test_plans_that_do_not_fit_are_refused_before_work(tiny_capture):
    f = tiny_capture.forward
    with pytest.raises(ShardingError, match="matches no input"):
        shard(f, {"attn.nope.weight": "colwise"}, DeviceMesh.of_size(2))
    with pytest.raises(ShardingError, match=r"attn.c_attn.weight .*axis 0 .*cannot be split over 3 devices"):
        shard(f, "megatron", DeviceMesh.of_size(3))


# -- propagation ------------------------------------------------------------------------------


def test_plan_annotations_are_never_overridden(gpt3):
    fwd, _ = gpt3
    s = shard(fwd, "megatron-sp", DeviceMesh.of_size(4))
    for name, p in s.annotations.placements.items():
        assert s.placement(name) == p


def test_values_made_inside_the_fusion_take_their_consumers_sharding(tiny_cfg):
    """Attention dropout's `uniform` and the causal mask's `iota` have no operands."""
    from nvtp.models import gpt
    from tests.conftest import make_block

    cfg = gpt.config("tiny", dropout=0.1)
    c = capture(make_block(cfg).train(), gpt.example_input(cfg), backward=False)
    s = shard(c.forward, "megatron", DeviceMesh.of_size(4))
    placement = {op.kind: s.placement(op.outputs[0].name) for op in s.fusion.compute_ops() if op.outputs[0].shape == (2, 4, 16, 16)}
    assert placement["uniform"] == Shard(1)  # heads, like the attention probabilities it masks
    iota = [op for op in s.fusion.compute_ops() if op.kind == "iota"]
    assert iota and all(s.placement(op.outputs[0].name) == Replicate() for op in iota)
    expanded = [op for op in s.fusion.compute_ops() if op.kind == "broadcast_in_dim" and op.outputs[0].dtype == DType.Bool and op.outputs[0].shape == (2, 4, 16, 16)]
    assert expanded and all(s.placement(op.outputs[0].name) == Shard(1) for op in expanded)  # the mask, broadcast per head


def test_merged_axes_split_inside_are_strided_splits(tiny_capture):
    """The backward's [b*s, e] activations gradient, reduce-scattered along the sequence s
    (b = 2), is _S(0, 2); reshaped back to [b, s, e] it is Shard(1)."""
    fwd, bwd = shard_pair(tiny_capture.forward, tiny_capture.backward, "megatron-sp", DeviceMesh.of_size(2))
    splits = [op for op in bwd.fusion.compute_ops() if op.kind == "reshape" and op.outputs[0].shape == (2, 16, 64)
              and bwd.placement(op.arg("arg").name) == _StridedShard(0, split_factor=2)]
    assert splits and all(bwd.placement(op.outputs[0].name) == Shard(1) for op in splits)
    rs = [c for c in bwd.communications if c.kind == "reduce_scatter"]
    assert rs and all(c.dst == _StridedShard(0, split_factor=2) for c in rs)


def test_a_reduction_over_a_split_axis_is_partial():
    b = FusionBuilder()
    x = b.define_tensor([4, 8], DType.Float, info=ValueInfo("activation", "x"))
    y = b.op("sum", x, dims=[1])
    b.add_output(y)
    f = b.build()
    prop = propagate_shardings(f, DeviceMesh.of_size(2), {x.name: Shard(1)})
    assert prop.placements[y.name] == Partial("sum")
    s = shard(f, {x.name: Shard(1)}, DeviceMesh.of_size(2))
    assert kinds(s) == ["allreduce"]  # outputs are never left partial


def test_conflicts_go_to_the_fewest_bytes():
    """x [2, 64] @ w [64, 1024]: with x split on k and w split on n, gathering x (128 floats) is
    cheaper than gathering w (64k floats)."""
    b = FusionBuilder()
    x = b.define_tensor([2, 64], DType.Float)
    w = b.define_tensor([64, 1024], DType.Float)
    b.add_output(b.op("matmul", x, w))
    f = b.build()
    s = shard(f, {x.name: Shard(1), w.name: Shard(1)}, DeviceMesh.of_size(2))
    gathered = [c.value for c in s.communications if c.kind == "allgather"]
    assert gathered == [x.name]


# -- Megatron's communication, exactly ------------------------------------------------------


def test_megatron_communicates_two_allreduces_each_way(gpt3):
    fwd, bwd = gpt3
    b, s_, e = 1, 2048, 12288
    for d in (2, 4, 8):
        sf, sb = shard_pair(fwd, bwd, "megatron", DeviceMesh.of_size(d))
        for sharded in (sf, sb):
            comms = sharded.communications
            assert [c.kind for c in comms] == ["allreduce", "allreduce"]
            for c in comms:
                v = sharded.source.value(c.value)
                assert v.numel == b * s_ * e and v.dtype == DType.BFloat16
                assert c.bytes == round(2 * (d - 1) / d * b * s_ * e * 2)  # ring allreduce, bf16
        # no weight gradient is communicated
        grads = {v.name for v in sb.fusion.outputs if sb.source.label(v.name).endswith("weight)")}
        assert not [c for c in sb.communications if c.value in grads]


def test_megatron_sp_communicates_gathers_and_reduce_scatters(gpt3):
    fwd, bwd = gpt3
    big = 1 * 2048 * 12288
    sf, sb = shard_pair(fwd, bwd, "megatron-sp", DeviceMesh.of_size(4))
    assert sorted(kinds(sf)) == ["allgather", "allgather", "reduce_scatter", "reduce_scatter"]
    assert all(sf.source.value(c.value).numel == big for c in sf.communications)
    large = [c for c in sb.communications if sb.source.value(c.value).numel == big]
    small = [c for c in sb.communications if sb.source.value(c.value).numel != big]
    assert sorted(c.kind for c in large) == ["allgather"] * 4 + ["reduce_scatter"] * 2  # 2 of the gathers re-gather LayerNorm outputs
    assert small and all(c.kind == "allreduce" and sb.source.value(c.value).numel == 12288 for c in small)  # LayerNorm and bias gradients


def test_sharding_passes_are_fast(gpt3):
    import time

    fwd, bwd = gpt3
    shard_pair(fwd, bwd, "megatron", DeviceMesh.of_size(4))  # warm
    seconds = []
    for _ in range(3):  # the best of 3: other jobs on a shared machine only ever add time
        start = time.perf_counter()
        shard_pair(fwd, bwd, "megatron", DeviceMesh.of_size(4))
        seconds.append(time.perf_counter() - start)
    # The target, 100 ms (benchmarks/test_compile.py asserts it on the median of 15 rounds);
    # measured on 2 cores at load 10: best 31 ms, median 51 ms, worst single call 140 ms.
    assert min(seconds) < 0.1, f"sharding passes took {1000 * min(seconds):.0f} ms at best of 3; the target is 100 ms"


def test_the_pipeline_times_each_pass_and_names_a_failing_one(gpt3, monkeypatch):
    from nvtp.sharding import passes as pipeline

    fwd, _ = gpt3
    s = shard(fwd, "megatron", DeviceMesh.of_size(2))
    assert list(s.seconds) == ["annotate", "propagate", "plan_reshards", "insert_reshards", "hoist_gathers", "verify"]

    def broken(*args):
        raise KeyError("T7")

    monkeypatch.setattr(pipeline, "hoist_gathers", broken)
    after = r"in pass hoist_gathers after \[annotate, propagate, plan_reshards, insert_reshards\]: KeyError: 'T7'"
    with pytest.raises(pipeline.PassError, match=after):
        shard(fwd, "megatron", DeviceMesh.of_size(2))


def test_gradients_go_where_the_forward_input_they_belong_to_lives(gpt3):
    """A gradient output's forward input is data (ValueInfo.grad_of; a dump's `grad(x)` label is
    read into it), not parsed out of the label by the passes: relabelled gradients still land
    where their parameters live."""
    from dataclasses import replace

    from nvtp.sharding.passes import backward_annotations

    fwd, bwd = gpt3
    assert bwd.grad_of(bwd.outputs[0].name) and all(bwd.label(v.name) == f"grad({bwd.grad_of(v.name)})" for v in bwd.outputs)
    relabelled = replace(bwd, info={n: replace(i, label=f"d{k}") if i.grad_of else i for k, (n, i) in enumerate(bwd.info.items())})
    forward = shard(fwd, "megatron", DeviceMesh.of_size(4))
    _, hints = backward_annotations(bwd, forward)
    _, relabelled_hints = backward_annotations(relabelled, forward)
    weight = next(v.name for v in bwd.outputs if bwd.grad_of(v.name) == "attn.c_attn.weight")
    assert len(hints) == len(bwd.outputs) and relabelled_hints == hints
    assert hints[weight] == _StridedShard(0, split_factor=3)


def test_a_captured_backward_records_its_gradients_forward_inputs(tiny_capture):
    from nvtp.ir.parser import parse
    from nvtp.ir.printer import format_file

    b = tiny_capture.backward
    params = {v.name: tiny_capture.forward.label(v.name) for v in tiny_capture.forward.inputs if tiny_capture.forward.role(v.name) == "parameter"}
    assert {b.grad_of(v.name) for v in b.outputs} == set(params.values()) | {"x"}
    assert parse(format_file(b)).fusion.info == b.info  # the dump's grad(x) labels read back into grad_of


# -- sharded runs equal the single-device run ---------------------------------------------------


def check_simulated(sharded, seed=0, tol=1e-5):
    inputs = dump.random_inputs(sharded.source, seed=seed)
    single = reference.run(sharded.source, inputs, seed=seed)
    # NaN compares equal to NaN: a non-finite single-device output would check nothing
    assert all(torch.isfinite(x).all() for x in single if isinstance(x, torch.Tensor)), "the inputs make a non-finite output"
    per_rank, logs = spmd.run_simulated(sharded, inputs, seed=seed)
    whole = spmd.assemble_outputs(sharded, per_rank)
    checks = dump.check_outputs(sharded.source, whole, single)
    assert checks and all(c.rel_error <= tol for c in checks), [(c.name, c.rel_error) for c in checks if c.rel_error > tol]
    # each rank ran exactly the collectives the plan lists
    planned = [c.kind for c in sharded.communications]
    assert all([x.kind for x in log if x.kind in COLLECTIVES] == planned for log in logs)


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_gpt_block_sharded_equals_single_device(tiny_capture, plan, d):
    fwd, bwd = shard_pair(tiny_capture.forward, tiny_capture.backward, plan, DeviceMesh.of_size(d))
    check_simulated(fwd)
    check_simulated(bwd)


# The nvfuser target of every block but one in the slow tier (3-4 s each): the reference target runs them all.
@pytest.mark.parametrize("name,target", [
    pytest.param(name, target, id=f"{target}-{name}", marks=[pytest.mark.slow] if target == "nvfuser" and name != "llama_gqa_bias" else [])
    for target in ("nvfuser", "reference") for name in sorted(BLOCKS)])
def test_other_blocks_sharded_equal_single_device(name, target):
    torch.manual_seed(0)
    c = capture(BLOCKS[name](), torch.randn(2, 16, 64, requires_grad=True))
    fwd, bwd = shard_pair(c.forward, c.backward, "megatron", DeviceMesh.of_size(4), target=target)
    check_simulated(fwd)
    check_simulated(bwd)
    if target == "reference":  # Megatron's count, from the block's structure (not from nvtp):
        # forward, one all-reduce per row-parallel linear (g): attention out and MLP out, 2;
        # backward, one per norm output read by column-parallel linears (f), the partial sums of
        # q/k/v (or gate/up, or attention and MLP in a parallel block) added before it.
        norm_outputs = 1 if name == "parallel_residual" else 2
        assert [c.kind for c in fwd.communications] == ["allreduce"] * 2
        assert [c.kind for c in bwd.communications] == ["allreduce"] * norm_outputs


def test_dropout_is_the_same_sharded_and_single(tiny_cfg):
    from nvtp.models import gpt
    from tests.conftest import make_block

    cfg = gpt.config("tiny", dropout=0.3)
    c = capture(make_block(cfg).train(), gpt.example_input(cfg))
    fwd, bwd = shard_pair(c.forward, c.backward, "megatron-sp", DeviceMesh.of_size(4))
    check_simulated(fwd, seed=5)
    check_simulated(bwd, seed=5)


# -- files and the command line --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    dump.dump_model("nanogpt", "tiny", out, dtype=torch.float32, dropout=0.1)
    return out / "nanogpt_tiny_fp32_fwd.py", out / "nanogpt_tiny_fp32_bwd.py"


def test_explain_json_lists_every_communication(tiny_files, capsys):
    assert cli.main(["explain", str(tiny_files[1]), "--plan", "megatron-sp", "--devices", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    comms = report["communications"]
    assert sorted({c["kind"] for c in comms}) == ["allgather", "allreduce", "reduce_scatter"]
    for c in comms:
        assert set(c) >= {"kind", "tensor", "shape", "dtype", "bytes"} and c["bytes"] > 0
    assert report["tensors"]["T0"]["placement"]


def test_explain_text_names_each_tensor_and_communication(tiny_files, capsys):
    assert cli.main(["explain", str(tiny_files[0]), "--plan", "megatron", "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "attn.c_attn.weight" in out and "_S(0, 3)" in out
    assert out.split("communications (")[1].count("allreduce") == 2


def test_shard_writes_nvfusers_format_with_the_schedule(tiny_files, tmp_path):
    out = tmp_path / "fwd_tp4.py"
    assert cli.main(["shard", str(tiny_files[0]), "--plan", "megatron", "--devices", "4", "--out", str(out)]) == 0
    text = out.read_text()
    assert "def nvfuser_fusion_id0(fd : FusionDefinition) -> None :" in text
    assert "mesh = nvfuser_direct.multidevice.DeviceMesh([0, 1, 2, 3])" in text
    assert ".parallelize(ParallelType.mesh_x)" in text and "fd.ops.set(" in text
    # Reading it back gives the same placements.
    from nvtp.dump.sharded import from_dump

    written = from_dump(dump.load(out))
    original = shard(dump.load(tiny_files[0]).fusion, "megatron", DeviceMesh.of_size(4))
    assert written.mesh.size == 4
    for name, placement in original.shardings.items():
        assert written.shardings[name] == placement, name


def test_nvfuser_holds_the_device_axes_nvtp_chose(tiny_files, tmp_path):
    """Build the sharded definition with nvfuser_direct (on CPU) and read each TensorView's loop
    domain: deviceIdx.x sits exactly on the axis nvtp split, and nowhere else."""
    import re

    from nvtp.dump.sharded import write_sharded
    from nvtp.execute.nvfuser import build_from_text, compare_definition
    from nvtp.sharding.schedule import device_axis

    sharded = shard(dump.load(tiny_files[0]).fusion, "megatron", DeviceMesh.of_size(4))
    out = tmp_path / "s.py"
    write_sharded(sharded, out, "test")
    fd = build_from_text(out.read_text(), str(out))  # nvFuser reads the file nvtp wrote, as its users do
    assert compare_definition(dump.load(out).fusion, fd) == []
    producers = sharded.fusion.producers()
    checked = 0
    for name, tv in fd.nvtp_values.items():
        if name not in sharded.shardings:
            continue
        text = str(tv)  # e.g. T3_g_float[iS394{3}, ideviceIdx.x396{4}, iS397{16}, iS6{64}] (DeviceMesh{0 1 2 3})
        axes = re.search(r"\[(.*?)\]", text).group(1).split(", ") if "[]" not in text else []
        device = [i for i, a in enumerate(axes) if "deviceIdx.x" in a]
        assert "DeviceMesh{0 1 2 3}" in text, text
        op = producers[name]
        where = device_axis(sharded, None if op.kind == "define_tensor" else op, op.outputs.index(sharded.fusion.value(name)), sharded.fusion.value(name))
        if where is None:
            assert device == [], (name, text)
        else:
            axis, sf = where
            assert device == [axis + (1 if sf > 1 else 0)], (name, text, where)
        checked += 1
    assert checked > 50


def test_reduce_scatter_lowers_to_one_nvfuser_tensor_with_both_device_axes(tiny_files, tmp_path):
    """nvFuser's reduce-scatter: the producer splits its reduction axis and the sequence axis
    over the devices (NVIDIA/Fuser's test_linear_reduce_scatter); the `set` after it is a copy."""
    from nvtp.dump.sharded import from_dump, write_sharded
    from nvtp.execute.nvfuser import build_from_text, compare_definition

    sharded = shard(dump.load(tiny_files[0]).fusion, "megatron-sp", DeviceMesh.of_size(2))
    out = tmp_path / "sp.py"
    write_sharded(sharded, out, "test")
    d = dump.load(out)
    fd = build_from_text(out.read_text(), str(out))
    assert compare_definition(d.fusion, fd) == []
    scattered = [s for s in from_dump(d).set_steps.values() if s.kind == "reduce_scatter"]
    assert len(scattered) == 2
    for step in scattered:
        text = str(fd.nvtp_values[step.value])
        assert "ideviceIdx.x" in text and "rdeviceIdx.x" in text, text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="sharded nvFuser execution needs 2+ CUDA GPUs (run under mpirun -np N); none here")
def test_sharded_fusion_runs_on_nvfuser(tmp_path):  # pragma: no cover - GPU only
    """Each rank's outputs are its part of the single-device reference's. Dropout 0: nvFuser's
    Philox stream is not the reference's generator, so dropped elements could never match."""
    import nvfuser_direct

    from nvtp.execute.nvfuser import execute_sharded

    comm = nvfuser_direct.multidevice.Communicator.instance()
    fwd, _ = dump.dump_model("nanogpt", "tiny", tmp_path, dtype=torch.float32, dropout=0.0)
    source = dump.load(fwd).fusion
    assert not {"uniform", "normal"} & {op.kind for op in source.ops}  # nothing random left to differ
    sharded = shard(source, "megatron", DeviceMesh.of_size(comm.size()))
    inputs = dump.random_inputs(sharded.source, seed=0)
    outs = execute_sharded(sharded, spmd.local_inputs(sharded, inputs, comm.rank()))
    single = reference.run(sharded.source, inputs, seed=0)
    assert len(outs) == len(sharded.fusion.outputs) == 10
    for v, got, whole in zip(sharded.fusion.outputs, outs, single):
        placement = sharded.placement(v.name)
        assert not is_partial(placement), f"{v.name} leaves the fusion as a partial sum ({placement})"
        want = spmd.shard_tensor(whole, placement, sharded.mesh, comm.rank())
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), v.name
        assert dump.relative_error(got.cpu(), want)[0] <= 1e-5, (v.name, placement)  # 2e-7 on the CPU mesh


def test_nvfuser_builds_the_schedule_data_as_it_reads_the_printed_schedule(gpt3):
    """execute_sharded builds from the schedule as data (schedule_steps); nvFuser must hold the
    same loop domains as when it reads the schedule `nvtp shard` prints."""
    import re

    from nvtp.dump.sharded import format_sharded
    from nvtp.execute.nvfuser import build_definition, build_from_text
    from nvtp.sharding.schedule import schedule_steps

    def loop_domain(tv):  # without nvFuser's running ids: T3_g_float[iS394{3}, ...] -> T_g_float[iS{3}, ...]
        return re.sub(r"([A-Za-z.]+)\d+\{", r"\1{", re.sub(r"^T\d+", "T", str(tv)))

    for sharded in shard_pair(*gpt3, "megatron-sp", DeviceMesh.of_size(2)):
        built = build_definition(sharded.fusion, schedule_steps(sharded))  # keep the definitions alive while
        read = build_from_text(format_sharded(sharded, []))  # their TensorViews are read
        names = [v.name for op in sharded.fusion.ops for v in op.outputs if v.name in sharded.shardings]
        assert sum("deviceIdx.x" in str(built.nvtp_values[n]) for n in names) > 100
        assert [loop_domain(built.nvtp_values[n]) for n in names] == [loop_domain(read.nvtp_values[n]) for n in names]


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_nvfuser_holds_the_device_axes_of_the_gpt3_backward(gpt3, plan):
    """Batch 1: nvFuser squeezes a reduced size-1 axis rather than reducing it (the bias and
    LayerNorm gradients sum over [b, s]), so the loop axes nvtp splits shift by one there."""
    import re

    from nvtp.dump.sharded import format_sharded
    from nvtp.execute.nvfuser import build_from_text, compare_definition
    from nvtp.ir.parser import parse
    from nvtp.sharding.schedule import device_axis

    _, sharded = shard_pair(*gpt3, plan, DeviceMesh.of_size(4))
    text = format_sharded(sharded, [])
    fd = build_from_text(text)
    assert compare_definition(parse(text).fusion, fd) == []
    producers = sharded.fusion.producers()
    checked = 0
    for name, tv in fd.nvtp_values.items():
        if name not in sharded.shardings or producers[name].kind != "sum":
            continue
        op = producers[name]
        axes = re.search(r"\[(.*?)\]", str(tv)).group(1).split(", ")
        where = device_axis(sharded, op, op.outputs.index(sharded.fusion.value(name)), sharded.fusion.value(name))
        device = [i for i, a in enumerate(axes) if "deviceIdx.x" in a]
        assert device == ([] if where is None else [where[0] + (1 if where[1] > 1 else 0)]), (name, str(tv), where)
        checked += 1
    assert checked >= 6


@pytest.fixture(scope="module")
def whole_gpt_capture():
    from nvtp.models import gpt

    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    return capture(gpt.GPT(cfg), *gpt.example_tokens(cfg))


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_a_whole_gpt_shards_for_nvfuser_with_replicated_embeddings(whole_gpt_capture, plan):
    """nvFuser keeps partial sums only on reduction axes, so for the nvFuser target the plan
    leaves the embedding table whole (the reference target splits it along the vocabulary); the
    sharded fusions lower to nvFuser with their schedule and compute the single-device result."""
    from nvtp.dump.sharded import format_sharded
    from nvtp.execute.nvfuser import build_from_text, compare_definition
    from nvtp.ir.parser import parse

    c = whole_gpt_capture
    mesh = DeviceMesh.of_size(2)
    fwd, bwd = shard_pair(c.forward, c.backward, plan, mesh)
    assert by_label(c.forward, fwd)["wte.weight"] == Replicate()
    assert by_label(c.forward, shard_pair(c.forward, None, plan, mesh, target="reference")[0])["wte.weight"] == Shard(0)
    for sharded in (fwd, bwd):
        text = format_sharded(sharded, [])
        fd = build_from_text(text)  # what nvFuser builds from the sharded file's text
        assert compare_definition(parse(text).fusion, fd) == []
        assert "ideviceIdx.x" in fd.fusion.print_math()
    check_simulated(fwd)
    check_simulated(bwd)


@pytest.mark.parametrize("told", ["operand", "hint"])
def test_renamed_copies_of_an_op_choose_each_by_its_own_neighbours(told):
    """The propagation reuses a choice for a renamed copy of an op (a spliced block's) only when
    its operands' placements and the hints on its values are those of the op that chose: here two
    copies of one linear, one told to split (its weight split, or a consumer wanting its result
    split) and one not, get different decisions, whichever decides first."""
    b = FusionBuilder()
    x, x2 = b.define_tensor((4, 8), DType.Float), b.define_tensor((4, 8), DType.Float)
    w, w2 = b.define_tensor((16, 8), DType.Float), b.define_tensor((16, 8), DType.Float)
    b.add_output(b.op("linear", x, w))
    f = b.build()
    op = f.ops[-1]
    copy = op.renamed(lambda v: {x.name: x2.name, w.name: w2.name}[v.name], lambda v: v.name + "c")
    f = f.with_ops(f.ops + (copy,), f.outputs + copy.outputs)
    mesh = DeviceMesh.of_size(2)
    if told == "operand":
        prop = propagate_shardings(f, mesh, {x.name: Replicate(), x2.name: Replicate(), w.name: Shard(0), w2.name: Replicate()})
    else:
        prop = propagate_shardings(f, mesh, {x.name: Replicate(), x2.name: Replicate()}, {op.outputs[0].name: Shard(1)})  # weights open
    assert copy.template is op
    assert prop.placements[op.outputs[0].name] == Shard(1) and prop.placements[copy.outputs[0].name] == Replicate()
