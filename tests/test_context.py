"""Context parallelism (issue 28): a mesh axis named "cp" splits the sequence, attention runs by ring.

Every case trains a copy of a model with ``nvtp.jit`` on a simulated mesh (ranks as threads,
``ThreadComm``; the multi-process case on gloo) and the same model once in eager PyTorch, which
computes the whole sequence on one process and shares no code with the ring: every step's loss
within 1e-5, the final weights within 1e-4. The ring's point-to-point steps are counted as they
run and compared with the plan's.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nvtp
from nvtp import driver
from nvtp.execute import ring, spmd
from nvtp.models import gpt
from nvtp.sharding.axes.cp import ContextError
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Zigzag, axis_split, held, local_indices

ROOT = Path(__file__).resolve().parents[1]
CFG = gpt.config("tiny")  # 2 layers, sequence 16, batch 2


def _placements(p) -> tuple:
    return p if isinstance(p, tuple) else (p,)


def train(model: nn.Module, mesh: DeviceMesh, args: tuple, steps: int, plan: str = "megatron", loss_of=lambda out: out,
          lr: float = 0.1, kwargs: dict | None = None, fsdp: bool = False):
    """``steps`` SGD steps of ``nvtp.jit(model)`` on every rank of a simulated ``mesh`` and of
    eager ``model`` on one process. Returns (nvtp's losses, eager's, the ranks, the eager model,
    the ring steps each rank ran per training step)."""
    threads = spmd.ThreadMesh(mesh, timeout=120)
    # verify=False: the first call's check (nvtp/guard.py) runs the program's ring once more; counted is the step's
    ranks = [nvtp.jit(copy.deepcopy(model), plan=plan, mesh=mesh, comm=threads.comm(r), fsdp=fsdp, verify=False)
             for r in range(mesh.size)]
    args_of = (lambda r: args) if "dp" not in mesh.names else (lambda r: _dp_part(args, mesh, r))  # a dp rank passes its batch
    kwargs = kwargs or {}
    ranks[0].compile(*args_of(0), **kwargs)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in ranks]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)

    def step(r):
        opts[r].zero_grad()
        loss = loss_of(ranks[r](*args_of(r), **kwargs))
        loss.backward()
        opts[r].step()
        return loss.item()

    got, want, sent = [], [], []
    for _ in range(steps):
        with ring.recording() as ran:
            losses = spmd.on_threads(step, threads)
        sent.append(ran)
        assert len(set(losses)) == 1, losses  # every rank gets the whole loss (a dp rank its batch's: here the same mean)
        got.append(losses[0])
        ref_opt.zero_grad()
        loss = loss_of(ref(*args, **kwargs))
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    return got, want, ranks, ref, sent


def _dp_part(args: tuple, mesh: DeviceMesh, rank: int) -> tuple:
    d, n = mesh.coords(rank)[mesh.names.index("dp")], mesh.shape[mesh.names.index("dp")]
    return tuple(a[d * a.shape[0] // n:(d + 1) * a.shape[0] // n] for a in args)


def check_matches(got, want, ranks, ref, mesh, fsdp: bool = False):
    """Losses within 1e-5, every weight (reassembled from the ranks' parts) within 1e-4;
    weights whole across cp (only a tp axis splits them) unless ``fsdp``."""
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (got, want)
    cp = mesh.names.index("cp")
    for name, p in ref.named_parameters():
        placement = _placements(ranks[0].placement(name))
        assert fsdp or placement[cp] == REPLICATE, (name, placement)
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        whole = spmd.assemble(parts, placement, p.shape, mesh)
        assert (whole - p.detach()).abs().max().item() <= 1e-4, name


def check_ring_ran_as_planned(program, sent, mesh):
    """The point-to-point steps every rank ran in a training step are the plan's, byte for byte,
    and the plan moves no whole K or V (no all-gather on cp)."""
    planned = [s for s in program.steps() if s.kind == "sendrecv"]
    assert planned, "the plan has no ring steps"
    for per_step in sent:
        assert len(per_step) == len(planned) * mesh.size
        assert sum(b for _, b in per_step) == sum(s.bytes for s in planned) * mesh.size
    for _, sharded in program.phases():  # no attention reads a gathered (whole) K or V
        for op in sharded.fusion.ops:
            if op.kind in ("sdpfa_fwd", "sdpfa_bwd"):
                gathered = [v.name for v in op.tensor_operands if v.name in sharded.set_steps
                            and sharded.set_steps[v.name].kind == "allgather"]
                assert not gathered, (op, gathered)
                assert all(axis_split(sharded.sharding(v.name)[mesh.names.index("cp")]) for v in op.tensor_operands[:4])


def test_cp2_gpt_trains_like_one_process():
    """The default-tier case: a 1-D mesh named "cp" (2 ranks) on nvtp's GPT: the sequence split,
    weights whole (not sharded as tp), attention by ring; 3 SGD steps equal eager's."""
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    mesh = DeviceMesh.of_shape((2,), ("cp",))
    args = gpt.example_tokens(CFG)
    got, want, ranks, ref, sent = train(model, mesh, args, 3)
    check_matches(got, want, ranks, ref, mesh)
    program = ranks[0].last
    check_ring_ran_as_planned(program, sent, mesh)
    # each rank holds half the sequence (a piece from each end) of every activation, the attention's operands included
    f = program.forward
    attn = next(op for op in f.fusion.ops if op.kind == "sdpfa_fwd")
    assert all(isinstance(f.sharding(v.name)[0], Zigzag) and axis_split(f.sharding(v.name)[0]) == (2, 2) for v in attn.tensor_operands)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names,plan", [((4,), ("cp",), "megatron"), ((2, 2), ("cp", "tp"), "megatron-sp"),
                                              ((2, 2), ("cp", "tp"), "megatron"), ((2, 2), ("dp", "cp"), "megatron"),
                                              ((2, 2, 2), ("dp", "cp", "tp"), "megatron-sp")])
def test_gpt_on_cp_meshes_trains_like_one_process(shape, names, plan):
    """cp = 4; cp with tp (Megatron, and SP: tp splits each of cp's pieces); dp with cp (each dp
    rank its half of the batch, the sequence split over cp); all three."""
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    mesh = DeviceMesh.of_shape(shape, names)
    got, want, ranks, ref, sent = train(model, mesh, gpt.example_tokens(CFG), 5, plan=plan)
    check_matches(got, want, ranks, ref, mesh)
    check_ring_ran_as_planned(ranks[0].last, sent, mesh)
    if "tp" in mesh.names:  # tp still splits the weights
        assert axis_split(_placements(ranks[0].placement("h.0.mlp.c_fc.weight"))[mesh.names.index("tp")]) is not None


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
def test_rotary_llama_style_model_trains_like_one_process(shape):
    """Rotary embeddings by complex numbers (a table sliced to T, as Llama's reference code):
    each rank's tokens turned by their global positions; grouped-query attention, RMSNorm, SwiGLU."""
    from tests.complex_rotary import ComplexRotaryLM, Config

    torch.manual_seed(0)
    model = ComplexRotaryLM(Config())
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    mesh = DeviceMesh.of_shape(shape, ("cp",) if len(shape) == 1 else ("cp", "tp"))

    def loss_of(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    plan = "megatron-sp" if len(shape) == 2 else "megatron"
    got, want, ranks, ref, sent = train(model, mesh, (tokens,), 4, plan=plan, loss_of=loss_of, lr=0.5)
    check_matches(got, want, ranks, ref, mesh)
    check_ring_ran_as_planned(ranks[0].last, sent, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names,plan", [((2, 2), ("dp", "cp"), "megatron"), ((2, 2, 2), ("dp", "cp", "tp"), "megatron-sp")])
def test_fsdp_with_cp_trains_like_one_process(shape, names, plan):
    """``fsdp=True`` on a mesh with dp and cp: the weights split over dp at rest and, along a
    dimension tp and dp leave whole, over cp (without tp: a weight [out, in] split over dp by rows,
    over cp by columns), gathered where used, their gradients reduce-scattered over both."""
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    mesh = DeviceMesh.of_shape(shape, names)
    got, want, ranks, ref, sent = train(model, mesh, gpt.example_tokens(CFG), 4, plan=plan, fsdp=True)
    check_matches(got, want, ranks, ref, mesh, fsdp=True)
    check_ring_ran_as_planned(ranks[0].last, sent, mesh)
    dp, cp = mesh.names.index("dp"), mesh.names.index("cp")
    split = [n for n, _ in model.named_parameters() if axis_split(_placements(ranks[0].placement(n))[dp]) is not None]
    assert "h.0.mlp.c_fc.weight" in split and "h.0.attn.c_attn.weight" in split, split
    on_cp = [n for n, _ in model.named_parameters() if axis_split(_placements(ranks[0].placement(n))[cp]) is not None]
    held = {n: _numel(dict(ranks[0].module.named_parameters())[n]) / _numel(p) for n, p in model.named_parameters()}
    if "tp" not in names:  # a weight [out, in]: rows over dp, columns over cp; each rank 1/4 of it
        assert "h.0.mlp.c_fc.weight" in on_cp and held["h.0.mlp.c_fc.weight"] == 1 / 4, (on_cp, held)
    else:  # tp and dp take both dimensions of a weight: whole over cp, and said so
        assert not any(n.endswith("c_fc.weight") for n in on_cp) and any("stays whole on cp" in x for x in ranks[0].notes), ranks[0].notes
    for axis in ("dp", "cp") if on_cp else ("dp",):
        kinds = {s.kind for s in ranks[0].last.steps() if s.axis == axis}
        assert {"allgather", "reduce_scatter"} <= kinds, (axis, kinds)


def _numel(t) -> int:
    return t.numel() if not hasattr(t, "to_local") else t.to_local().numel()


def test_transformers_llama_on_cp2_trains_like_one_process():
    """A transformers Llama (the FX route; rotary positions, grouped-query attention) passes its
    causal mask to attention as a tensor built from positions: traced for a cp axis, that mask is
    read as is_causal=True, and the model trains by ring like one process (3 SGD steps, the loss
    the model computes from ``labels``)."""
    from nvtp.models import hf

    model = hf.build("llama")
    ids = hf.batch(0)
    mesh = DeviceMesh.of_shape((2,), ("cp",))
    got, want, ranks, ref, sent = train(model, mesh, (ids,), 3, loss_of=lambda out: out.loss, kwargs={"labels": ids})
    check_matches(got, want, ranks, ref, mesh)
    program = ranks[0].last
    check_ring_ran_as_planned(program, sent, mesh)
    attn = [op for op in program.forward.fusion.ops if op.kind == "sdpfa_fwd"]
    assert len(attn) == 2 and all(op.arg("is_causal") is True for op in attn), attn  # one per layer, causal, no mask
    assert "whole trace" not in program.traced.how, program.traced.how  # the layers still traced once and spliced


@pytest.mark.slow
@pytest.mark.parametrize("family,shape,names,plan", [("gpt2", (2,), ("cp",), "megatron"), ("qwen2", (4,), ("cp",), "megatron"),
                                                     ("llama", (2, 2), ("cp", "tp"), "megatron-sp")])
def test_transformers_models_on_cp_meshes_train_like_one_process(family, shape, names, plan):
    """GPT-2 (learned positions) and Qwen2 on cp alone, Llama on (cp, tp) with sequence parallelism:
    each mask read as causal, 3 SGD steps like one process."""
    from nvtp.models import hf

    model = hf.build(family)
    ids = hf.batch(0)
    mesh = DeviceMesh.of_shape(shape, names)
    got, want, ranks, ref, sent = train(model, mesh, (ids,), 3, plan=plan, loss_of=lambda out: out.loss, kwargs={"labels": ids})
    check_matches(got, want, ranks, ref, mesh)
    check_ring_ran_as_planned(ranks[0].last, sent, mesh)


def test_a_mask_read_as_causal_is_exactly_the_causal_one():
    """``fx_constants.is_causal_mask``: the pattern ``is_causal=True`` applies (booleans, or 0 and -inf,
    broadcast over batch and heads) and nothing else."""
    from nvtp.frontend.fx_constants import is_causal_mask

    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    assert is_causal_mask(tril, 6, 6) and is_causal_mask(tril.expand(2, 1, 6, 6), 6, 6)
    assert is_causal_mask(torch.zeros(6, 6).masked_fill(~tril, float("-inf")), 6, 6)
    window = tril & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)  # sliding window of 3
    padded = tril.expand(2, 1, 6, 6).clone()
    padded[1, :, :, 0] = False  # the second sequence's first token is padding
    for other in (window, tril.T, torch.ones(6, 6, dtype=torch.bool), padded, torch.ones(6, 6, dtype=torch.bool).tril(1),
                  torch.zeros(6, 6).masked_fill(~tril, -1.0)):
        assert not is_causal_mask(other, 6, other.shape[-1]), other


def test_plan_at_cp4_shows_the_ring_and_activations_fall_as_1_over_cp():
    """``nvtp.plan`` at cp = 4: the ring's point-to-point steps with their bytes (each rank sends
    its K and V block cp-1 times a layer in the forward), no all-gather; the activations each
    rank saves fall as 1/cp (one trace, sharded for cp = 1, 2, 4 by the driver)."""
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    idx, tgt = gpt.example_tokens(CFG)
    report = nvtp.plan(model, idx, tgt, mesh=DeviceMesh.of_shape((4,), ("cp",)))
    text = report.as_text()
    assert "sendrecv" in text and "allgather" not in text, text
    comms = report.communications()
    ring_fwd = [c for c in comms if c["kind"] == "sendrecv" and c["phase"] == "forward"]
    block = CFG.batch * CFG.n_head * (CFG.seq_len // 4) * CFG.head_dim * 4  # one rank's K (or V) block, float32
    assert len(ring_fwd) == 2 * 3 * CFG.n_layer and all(c["bytes"] == block for c in ring_fwd)
    ring_bwd = [c for c in comms if c["kind"] == "sendrecv" and c["phase"] == "backward"]
    assert len(ring_bwd) == (2 * 3 + 2 * 4) * CFG.n_layer
    traced = driver.trace(model, (idx, tgt), ring=True)
    acts = {cp: driver.shard(traced, "megatron", DeviceMesh.of_shape((cp,), ("cp",))).report().memory_per_rank()["activations"]
            for cp in (1, 2, 4)}
    assert acts[4] == report.memory_per_rank()["activations"]
    assert abs(acts[1] / acts[2] - 2) < 0.05 and abs(acts[1] / acts[4] - 4) < 0.1, acts


    # The balanced layout: rank r holds pieces r and 2cp-1-r of the sequence, so the causal work
    # (query-key pairs the mask leaves, each block cut to the rows and columns it reaches) is the
    # same on every rank every ring step; counted here from the program's own placements.
    program = driver.shard(traced, "megatron", DeviceMesh.of_shape((4,), ("cp",)))
    attn = next(op for op in program.forward.fusion.ops if op.kind == "sdpfa_fwd")
    k = attn.arg("key")
    assert isinstance(program.forward.sharding(k.name)[0], Zigzag)
    positions = [local_indices(CFG.seq_len, program.forward.sharding(k.name)[0], 4, r) for r in range(4)]
    assert positions[0].tolist() == [0, 1, 14, 15]
    pairs, cells = ring_work(program)
    assert all(len(set(step)) == 1 for step in pairs), pairs  # contiguous chunks would give 3, 7, 11, 15 blocks' worth
    assert [c[0] for c in cells] == [16, 8, 8, 8] and all(len(set(c)) == 1 for c in cells), cells  # the diagonal whole, the others half

    # FSDP over dp x cp, as the report prints it (a (dp, cp) mesh has no tp: the dp traffic is counted on whole weights)
    text = driver.shard(traced, "megatron", DeviceMesh.of_shape((2, 2), ("dp", "cp")), fsdp=True).report().as_text()
    assert re.search(r"h\.\{0\.\.1\}\.mlp\.c_fc\.weight\s+dp S\(0\), cp S\(1\)", text), text

    # With tp (megatron-sp splits the sequence over tp too; dp the batch): still the same work
    # on every cp rank every ring step (cp splitting each of tp's chunks, _StridedShard(1, tp),
    # gave cp rank 1 three times rank 0's work at the second step of (cp, tp) = (2, 2)).
    for shape, names in (((2, 2), ("cp", "tp")), ((4, 2), ("cp", "tp")), ((2, 4), ("cp", "tp")), ((2, 2, 2), ("dp", "cp", "tp"))):
        mesh = DeviceMesh.of_shape(shape, names)
        program = driver.shard(traced, "megatron-sp", mesh)
        pairs, cells = ring_work(program)
        assert all(len(set(step)) == 1 for step in pairs), (shape, names, pairs)
        assert all(len(set(step)) == 1 for step in cells), (shape, names, cells)
        # tp still splits the sequence where megatron-sp does (a layer norm's [B, T, C] input): each
        # token on exactly one (cp, tp) rank
        norm_in = next(op for op in program.forward.fusion.ops if op.kind == "var_mean").tensor_operands[0]
        sharding = program.forward.sharding(norm_in.name)
        tokens = [held(norm_in.shape, sharding, mesh, mesh.coords(r))[1] for r in range(mesh.size)
                  if "dp" not in names or mesh.coords(r)[0] == 0]
        assert sorted(torch.cat(tokens).tolist()) == list(range(CFG.seq_len)), (names, sharding)


def ring_work(program) -> tuple[list[list[int]], list[list[int]]]:
    """Per ring step, per cp rank: the query-key pairs the causal mask leaves between the rank's
    queries and the K/V block at hand, and the cells the ring computes (each block cut to the rows
    and columns it reaches, ``ring._visible``); positions from the program's placements."""
    f = program.forward
    mesh = f.mesh
    attn = next(op for op in f.fusion.ops if op.kind == "sdpfa_fwd")
    k = attn.arg("key")
    axis = mesh.names.index("cp")
    n = mesh.shape[axis]
    positions = []
    for c in range(n):
        coords = [0] * mesh.ndim
        coords[axis] = c
        positions.append(held(k.shape, f.sharding(k.name), mesh, coords)[2])
    assert sorted(torch.cat(positions).tolist()) == list(range(k.shape[2]))  # every position on one cp rank
    pairs, cells = [], []
    for step in range(n):
        pairs.append([]), cells.append([])
        for c in range(n):
            q, kp = positions[c], positions[(c - step) % n]
            pairs[-1].append(int((q[:, None] >= kp[None, :]).sum()))
            rows, cols = ring._visible(q, kp, True)
            cells[-1].append(0 if isinstance(rows, str) else
                             (q.numel() if rows is None else rows.numel()) * (kp.numel() if cols is None else cols.numel()))
    return pairs, cells


class MaskedAttention(nn.Module):
    """Attention with an arbitrary (padding) mask: the ring cannot run it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def test_bad_input_is_refused_before_any_work():
    """A sequence cp does not divide, and attention with an arbitrary mask: a clear error naming
    the fix, from nvtp.plan (nothing runs)."""
    torch.manual_seed(0)
    model = gpt.GPT(gpt.config("tiny", n_layer=1, seq_len=20, batch=1))
    idx, tgt = gpt.example_tokens(model.cfg)
    with pytest.raises(ContextError, match="length 20 cannot be split over the cp axis of size 4.*multiple of 8"):
        nvtp.plan(model, idx, tgt, mesh=DeviceMesh.of_shape((4,), ("cp",)))
    x = torch.randn(2, 8, 32)
    mask = torch.rand(2, 2, 8, 8) > 0.5
    with pytest.raises(ContextError, match="attn_mask.*is_causal=True"):
        nvtp.plan(MaskedAttention(), x, mask, mesh=DeviceMesh.of_shape((2,), ("cp",)))


def test_a_transformers_model_with_a_padding_mask_is_refused_on_cp():
    """A transformers model called with an ``attention_mask`` (padding): the mask its attention
    reads depends on an argument, so it is not read as causal, and the cp axis refuses it."""
    from nvtp.models import hf

    ids = hf.batch(0)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0
    with pytest.raises(ContextError, match="attn_mask.*is_causal=True.*computed from positions alone"):
        nvtp.plan(hf.build("llama"), ids, attention_mask=padding, labels=ids, mesh=DeviceMesh.of_shape((2,), ("cp",)))


@pytest.mark.slow
@pytest.mark.parametrize("procs,extra", [(2, []), (4, ["dp,cp", "--fsdp"])])
def test_cp2_on_gloo_processes_by_torchrun(tmp_path, procs, extra):
    """torch.distributed's point-to-point steps (batch_isend_irecv on gloo) on a mesh from
    ``init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))``, and on (dp, cp) = (2, 2) with
    ``fsdp=True`` (DTensor parameters split over dp x cp); losses and weights against eager."""
    script = ROOT / "tests" / "cp_worker.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "cp.pt"
    from torch.distributed.elastic.utils.distributed import get_free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
                           str(get_free_port()), str(script), str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(out)
    for a, b in zip(result["losses"], result["eager"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), result
    assert result["weight_error"] <= 1e-4, result
    assert result["sendrecv"] == 3 * result["planned"] > 0  # rank 0's steps: 3 training steps of the plan's
    if extra:  # FSDP over dp x cp: rank 0 holds less than half of the weights (the 2-D weights a quarter)
        assert result["held"] < 0.5, result


def test_the_ring_step_fusions_build_in_nvfuser_from_their_text_and_merge_right(tmp_path):
    """``Program.write_nvfuser`` at cp = 2 writes the forward, the backward and the ring's per-step
    fusions (attention on one K/V block, then the log-sum-exp merge); nvfuser_direct builds each
    from its text (no GPU needed), and the merge, run from the parsed text, turns attention on one
    block into attention on two (against eager attention on the whole keys)."""
    from nvtp.execute.nvfuser import build_from_text
    from nvtp.execute.reference import run
    from nvtp.ir.parser import parse

    torch.manual_seed(0)
    model = gpt.GPT(gpt.config("tiny", n_layer=1))
    idx, tgt = gpt.example_tokens(model.cfg)
    program = driver.compile(model, idx, tgt, mesh=DeviceMesh.of_shape((2,), ("cp",)))
    paths = program.write_nvfuser(tmp_path)
    assert [p.name for p in paths] == ["program_fwd.py", "program_bwd.py", "program_ring_step_diagonal.py",
                                       "program_ring_step_half.py"]
    for path in paths:
        build_from_text(path.read_text(), str(path))
    half = parse(paths[3].read_text(), str(paths[3])).fusion
    q_shape, k_shape = half.inputs[0].shape, half.inputs[1].shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(q_shape, generator=g).bfloat16()
    k1, v1, k2, v2 = (torch.randn(k_shape, generator=g).bfloat16() for _ in range(4))
    scale = 1 / q_shape[-1] ** 0.5
    s1 = (q.float() @ k1.float().transpose(-2, -1)) * scale
    lse1 = torch.logsumexp(s1, -1)
    out1 = torch.softmax(s1, -1) @ v1.float()
    merged, lse = run(half, [q, k2, v2, out1, lse1])
    want = F.scaled_dot_product_attention(q.float(), torch.cat([k1, k2], 2).float(), torch.cat([v1, v2], 2).float())
    assert (merged - want).abs().max().item() < 2e-2
    assert (lse - torch.logsumexp(torch.cat([s1, (q.float() @ k2.float().transpose(-2, -1)) * scale], -1), -1)).abs().max() < 2e-2


def test_nvtp_explain_on_the_command_line_shows_the_ring():
    """``nvtp explain --mesh cp=4`` (a subprocess, as a user runs it): the ring's sendrecv steps on
    cp, per layer, with their bytes, no all-gather; a misspelt mesh is refused with the spelling."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nvtp", "explain", "--plan", "megatron", "--model", "nanogpt", "--config", "tiny", "--mesh", "cp=4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "the sequence split over cp" in out and "allgather" not in out, out
    # bf16 blocks [2, 4, 4, 16] (one rank's K or V): 6 a layer forward, 6 backward; their gradients' float32 accumulators 8
    assert re.search(r"forward\s+block\s+on cp\s+12 x sendrecv\s+BFloat16\[2, 4, 4, 16\]\s+\(6 per layer\)\s+12.00 KiB", out), out
    assert re.search(r"backward\s+block\s+on cp\s+12 x sendrecv\s+BFloat16\[2, 4, 4, 16\]\s+\(6 per layer\)\s+12.00 KiB", out), out
    assert re.search(r"backward\s+block\s+on cp\s+16 x sendrecv\s+Float\[2, 4, 4, 16\]\s+\(8 per layer\)\s+32.00 KiB", out), out
    bad = subprocess.run(cmd[:-1] + ["cp4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "cp=4" in bad.stderr, bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["cp=4", "cp=2,tp=2"])
def test_nvtp_demo_with_a_cp_axis_passes(mesh):
    """``nvtp demo --mesh cp=4``: 4 gloo processes train the demo's GPT with the sequence split
    over cp, checked against one process; the ring's point-to-point steps are printed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "nvtp", "demo", "--mesh", mesh, "--steps", "5"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the sequence split over cp, attention by ring" in proc.stdout
    assert re.search(r"forward on cp, ring attention: \d+ point-to-point steps", proc.stdout), proc.stdout
    assert re.search(r"tolerance 1e-4: PASSED$", proc.stdout, re.M), proc.stdout
