"""Mixture-of-experts models (issue 35, item 1): transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and
OLMoE (both experts implementations) and nvtp's MoE GPT (``nvtp.models.moe``) train like one
process on tp, (dp, tp) and dp+FSDP meshes, on cp and pp once each.

Every run is compared with the unsharded model in eager PyTorch on one process (transformers'
own experts implementation, not nvtp's): losses and logits within 1e-5 relative, every gradient
(every expert's, one expert that no token chose included) within 1e-4, or the weights after SGD
steps within 1e-5. Models are tiny (hidden 64, 4 experts, top-2, 2 layers, vocabulary 256, fp32).

Default tier (simulated ranks, threads of this process; each model traced once, 10-45 s on the
shared 2-core machine): the experts formulation against transformers' three implementations (no
trace), Mixtral at tp=2 with its load-balancing loss, nvtp's MoE GPT at (dp, tp) = (2, 1) with
an expert no token chooses, and the plan of an MoE GPT. Slow tier: every family and experts
implementation at tp=2 and (dp, tp) = (2, 1), (2, 2) FSDP on gloo processes, cp=2, pp=2, the CLI.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")

import nvtp  # noqa: E402
from nvtp.dump import relative_error  # noqa: E402
from nvtp.execute import spmd  # noqa: E402
from nvtp.execute.launch import spawn  # noqa: E402
from nvtp.frontend import moe as frontend_moe  # noqa: E402
from nvtp.models import moe  # noqa: E402
from nvtp.sharding.placements import DeviceMesh  # noqa: E402
from tests.test_hf import Mesh, check_parity  # noqa: E402

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
              intermediate_size=128, use_cache=False, max_position_embeddings=64, num_experts_per_tok=2,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def build(family: str, implementation: str | None = None, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny causal LM of ``family`` (4 experts, top-2), fp32, seeded; ``implementation`` names the
    experts implementation (None: transformers' default, grouped_mm)."""
    t = transformers
    torch.manual_seed(seed)
    cfg, cls = {
        "mixtral": (lambda: t.MixtralConfig(**COMMON, num_local_experts=4, **extra), t.MixtralForCausalLM),
        "qwen2_moe": (lambda: t.Qwen2MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                               **extra), t.Qwen2MoeForCausalLM),  # with a shared expert
        "qwen3_moe": (lambda: t.Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=32, head_dim=16, **extra),
                      t.Qwen3MoeForCausalLM),
        "olmoe": (lambda: t.OlmoeConfig(**COMMON, num_experts=4, **extra), t.OlmoeForCausalLM),
        "gpt_oss": (lambda: t.GptOssConfig(**(COMMON | {"intermediate_size": 32}), num_local_experts=4, head_dim=16, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"], **extra), t.GptOssForCausalLM),
    }[family]
    kwargs = {"experts_implementation": implementation} if implementation else {}
    return cls._from_config(cfg(), **kwargs)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if frontend_moe.is_transformers_experts(m)]


def routed(model: torch.nn.Module, *args, **kwargs) -> list[torch.Tensor]:
    """How many rows each expert of each layer receives when the eager model runs the call."""
    counts = []

    def record(module, inputs, output):
        counts.append(torch.bincount(inputs[1].reshape(-1), minlength=module.num_experts))

    hooks = [m.register_forward_hook(record) for m in experts_modules(model)]
    with torch.no_grad():
        model(*args, **kwargs)
    for h in hooks:
        h.remove()
    return counts


def tokens_leaving_an_expert_idle(model: torch.nn.Module, shape: tuple[int, int]) -> torch.Tensor:
    """The first seeded batch of ``shape`` after which some expert of some layer gets no token."""
    for seed in range(100):
        ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))
        if any((c == 0).any() for c in routed(model, ids)):
            return ids
    raise AssertionError(f"no batch of shape {shape} leaves an expert idle")


# -- the experts formulation, against transformers' own implementations (no trace) ----------------


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_forward_computes_what_every_experts_implementation_computes(family):
    """nvtp's ``experts_forward`` (gather_mm, static shapes) equals transformers' eager loop,
    grouped_mm and batched_mm implementations, values and gradients, with expert 2 chosen by no
    token (its weight gradient zero in all four)."""
    model = build(family)
    experts = experts_modules(model)[0]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 64, generator=g)
    index = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [1, 0], [3, 1]])  # no row for expert 2
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1)

    def run(forward):
        e = copy.deepcopy(experts)
        x = hidden.clone().requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        out = forward(e, x, index, w)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [out.detach(), x.grad, w.grad] + [p.grad for p in e.parameters()]

    def implementation(name):
        def forward(e, x, i, w):
            e.config._experts_implementation = name
            return e(x, i, w)
        return forward

    ours = run(frontend_moe.experts_forward)
    for name in ("eager", "grouped_mm", "batched_mm"):
        theirs = run(implementation(name))
        for a, b in zip(ours, theirs):
            assert relative_error(a, b)[0] <= 1e-6, name
    for p in ours[3:]:
        assert p[2].abs().max() == 0 and p[0].abs().max() > 0  # the idle expert's gradient is zero, the others' not


# -- transformers models on simulated meshes ---------------------------------------------------


def _dp_part(ids: torch.Tensor, mesh: DeviceMesh, rank: int) -> torch.Tensor:
    names = mesh.names
    dp = mesh.shape[names.index("dp")]
    k = mesh.coords(rank)[names.index("dp")]
    return ids[k * ids.shape[0] // dp:(k + 1) * ids.shape[0] // dp]


def train_simulated(model: torch.nn.Module, shape: tuple[int, ...], names: tuple[str, ...], batch: tuple[torch.Tensor, ...],
                    steps: int = 2, fsdp: bool = False, hf: bool = True):
    """``steps`` SGD steps on a simulated mesh (each dp rank its rows of ``batch``) and in eager on
    the whole batch: a transformers model called ``model(ids, labels=ids)`` (``hf``), else
    ``model(*batch)`` returning the loss. Returns (each rank's losses, the eager losses, the worst
    relative difference of a final weight, the ranks)."""
    mesh = DeviceMesh.of_shape(shape, names)
    threads = spmd.ThreadMesh(mesh, timeout=300)
    part = (lambda r: tuple(_dp_part(t, mesh, r) for t in batch)) if "dp" in names else (lambda r: batch)
    call = (lambda m, b: m(b[0], labels=b[0]).loss) if hf else (lambda m, b: m(*b))
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), fsdp=fsdp) for r in range(mesh.size)]
    if hf:
        ranks[0].compile(part(0)[0], labels=part(0)[0])
    else:
        ranks[0].compile(*part(0))
    for m in ranks[1:]:
        m.share_compiled(ranks[0])

    def train(m, b):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            loss = call(m, b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    got = spmd.on_threads(lambda r: train(ranks[r], part(r)), threads)
    ref = copy.deepcopy(model)
    want = train(ref, batch)
    worst = 0.0
    for name, p in ref.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        whole = spmd.assemble(parts, ranks[0].placement(name), p.shape, mesh)
        worst = max(worst, relative_error(whole, p.detach())[0])
    return got, want, worst, ranks


def check_training(got, want, worst):
    for losses in got:
        for a, b in zip(losses, want):
            assert abs(a - b) <= 1e-5 * abs(b), (got, want)
    assert worst <= 1e-5, worst


def test_mixtral_with_its_load_balancing_loss_at_tp2_matches_eager(caplog):
    """Mixtral (transformers' default experts implementation, whose grouped_mm_fallback Thunder
    does not know) with ``output_router_logits``: the loss adds the load-balancing loss (top-k,
    one-hot counts by histc). Megatron splits every expert's ffn: gate|up column-parallel in two
    parts, down row-parallel. One step, a batch after which an expert is idle: loss, logits,
    every gradient. Quietly: the run on fake tensors that groups the layers ran transformers'
    grouped_mm, whose fp32 meta check torch logs as an error with a traceback on every rank."""
    model = build("mixtral", output_router_logits=True)
    ids = tokens_leaving_an_expert_idle(model, (2, 4))
    with caplog.at_level("ERROR", logger="torch._subclasses.fake_tensor"):
        mesh = Mesh(model, 2, "megatron", ids, labels=ids)
    assert not [r for r in caplog.records if r.name.startswith("torch")], caplog.text[:500]
    worst = check_parity(model, mesh, ids)
    m = mesh.ranks[0]
    assert str(m.placement("model.layers.0.mlp.experts.gate_up_proj")) == "_S(1, 2)"  # [E, 2I, H]: gate and up each split
    assert str(m.placement("model.layers.0.mlp.experts.down_proj")) == "S(2)"  # [E, H, I]: row-parallel
    assert str(m.placement("model.layers.0.mlp.gate.weight")) == "R"  # the router stays whole
    assert worst["split"] == 14, worst
    program = m.last
    assert {"topk", "gather_mm"} <= {op.kind for op in program.forward.fusion.ops}
    assert "gather_mm_wgrad" in {op.kind for op in program.backward.fusion.ops}


def test_output_hooks_skip_modules_the_registry_answers_none_for(monkeypatch):
    """transformers 5.17's ``_CAN_RECORD_REGISTRY.get`` answers None for a module that records
    nothing (5.23 an empty mapping): installing the recorders must skip it, not fail before tracing
    (a transformers Llama failed so on the GPU machine's image; docs/gpu.md 2026-11-27)."""
    output_capturing = pytest.importorskip("transformers.utils.output_capturing")
    model = build("mixtral")
    real = output_capturing._CAN_RECORD_REGISTRY.get
    assert any(not real(m) for m in model.modules()), "every module records: the None answer is not exercised"
    monkeypatch.setattr(output_capturing._CAN_RECORD_REGISTRY, "get", lambda m: real(m) or None)
    frontend_moe.install_output_hooks(model, {"output_router_logits": True})
    hooked = [m for m in model.modules() if any(getattr(h, "__name__", "") == "output_capturing_hook" for h in m._forward_hooks.values())]
    assert hooked, "the model's router-logit recorders were not installed"


def test_moe_gpt_with_idle_experts_trains_at_dp2_like_one_process():
    """nvtp's MoE GPT on the thunder.jit route at (dp, tp) = (2, 1): each dp rank its half of the
    batch, the load-balancing loss over the whole batch (its sums all-reduced), 2 SGD steps.
    Layer 0's LayerNorm is set so that every token goes to the same two experts: two are idle."""
    cfg = moe.config("tiny", batch=4)
    torch.manual_seed(0)
    model = moe.MoEGPT(cfg)
    with torch.no_grad():
        model.h[0].ln_2.weight.fill_(1e-4)  # every token's router input is nearly ln_2's bias: one choice for all
        model.h[0].ln_2.bias.copy_(torch.linspace(-1, 1, cfg.n_embd))
    batch = moe.example_tokens(cfg)
    seen = []
    hook = model.h[0].moe.experts.register_forward_hook(lambda mod, inputs, out: seen.append(inputs[1].unique()))
    model(*batch)
    hook.remove()
    assert len(seen[0]) == 2, seen  # two of the four experts receive every token, two none
    got, want, worst, _ = train_simulated(model, (2, 1), ("dp", "tp"), batch, hf=False)
    check_training(got, want, worst)


def test_the_plan_of_an_moe_gpt_names_its_moe_layers_and_its_nvfuser_files_build(tmp_path):
    """One trace of the MoE GPT (a batch of 4), sharded three ways. For the reference backend at
    tp=2, what ``nvtp explain`` prints: each block's experts split Megatron's way and one line per
    MoE layer (experts, top-k, routed rows, what a rank holds). For nvFuser at tp=2 and at
    (dp, tp) = (2, 2): the experts stay whole (nvFuser's gather_mm cannot hold a row-parallel
    partial sum), and every file the program writes builds in nvfuser_direct from its text,
    ``nvtp_ops`` included, with nvtp's fusion (the experts' weight gradients split over dp)."""
    from nvtp import driver
    from nvtp.execute.nvfuser import build_from_text, compare_definition
    from nvtp.ir.parser import parse

    model, (idx, targets) = moe.tiny()
    traced = driver.trace(model, (idx, targets), batch=2)
    text = driver.shard(traced, "megatron", DeviceMesh.of_size(2)).as_text()
    assert "h.{0..1}.moe.experts.w_fc                S(2)" in text, text
    assert "h.{0..1}.moe.experts.w_proj              S(1)" in text, text
    assert ("h.{0..1}.moe.experts                     MoE: 4 experts, top-2, 128 routed rows (64 tokens x 2); "
            "expert weights w_fc tp S(2), w_proj tp S(1)") in text, text
    for mesh in (DeviceMesh.of_size(2), DeviceMesh.of_shape((2, 2), ("dp", "tp"))):
        program = driver.shard(traced, "megatron", mesh, backend="nvfuser")
        assert "top-2, 128 routed rows (64 tokens x 2); expert weights w_fc whole, w_proj whole" in program.as_text()
        paths = program.write_nvfuser(tmp_path / "x".join(map(str, mesh.shape)))
        assert [p.name for p in paths] == ["program_fwd.py", "program_bwd.py"]
        for path in paths:
            source = path.read_text()
            assert "nvtp_ops.gather_mm(fd," in source
            assert compare_definition(parse(source, str(path)).fusion, build_from_text(source, str(path))) == []


# -- slow tier: every family and experts implementation, processes, cp, pp, the CLI ------------------


@pytest.mark.slow
@pytest.mark.parametrize("implementation", [None, "eager"], ids=["grouped_mm", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_at_tp2_matches_eager(family, implementation):
    """One step at tp=2 (megatron): loss, logits and every gradient, a batch after which an expert is idle."""
    model = build(family, implementation)
    ids = tokens_leaving_an_expert_idle(model, (2, 4))
    worst = check_parity(model, Mesh(model, 2, "megatron", ids, labels=ids), ids)
    assert worst["split"] >= 10, worst


@pytest.mark.slow
@pytest.mark.parametrize("implementation", [None, "eager"], ids=["grouped_mm", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_at_dp2_trains_like_one_process(family, implementation):
    """(dp, tp) = (2, 1), the load-balancing loss on (over the whole batch): 2 SGD steps."""
    model = build(family, implementation, output_router_logits=True)
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    check_training(*train_simulated(model, (2, 1), ("dp", "tp"), (ids,))[:3])


def _gloo_worker(rank, world, init_method, out, implementation):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    part = ids[2 * mesh.get_local_rank("dp"):2 * mesh.get_local_rank("dp") + 2]
    model = nvtp.jit(build("mixtral", implementation, output_router_logits=True), plan="megatron", mesh=mesh, fsdp=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(part, labels=part).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    whole = {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}
    placements = {n: [type(q).__name__ for q in p.placements] for n, p in model.module.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "placements": placements}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("implementation", [None, "eager"], ids=["grouped_mm", "eager"])
def test_mixtral_trains_on_a_2x2_fsdp_mesh_of_gloo_processes(tmp_path, implementation):
    """Four gloo processes, (dp, tp) = (2, 2) with FSDP: every expert split over tp inside its ffn
    and over dp at rest; 2 SGD steps with the load-balancing loss like one process."""
    out = tmp_path / "got.pt"
    assert spawn(_gloo_worker, 4, str(out), implementation) == [0] * 4
    got = torch.load(out)
    model = build("mixtral", implementation, output_router_logits=True)
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(got["losses"][step] - loss.item()) <= 1e-5 * abs(loss.item()), (got["losses"], step, loss.item())
    for name, p in model.named_parameters():
        assert relative_error(got["params"][name], p.detach())[0] <= 1e-5, name
    assert got["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ["Shard", "_StridedShard"]
    assert got["placements"]["model.layers.0.mlp.experts.down_proj"] == ["Shard", "Shard"]


@pytest.mark.slow
def test_mixtral_on_cp2_trains_like_one_process():
    """Context parallelism: the sequence split over cp=2, attention by ring, the experts whole on
    each rank (they see that rank's tokens); 2 SGD steps with the load-balancing loss."""
    from tests.test_context import check_matches, check_ring_ran_as_planned, train

    model = build("mixtral", output_router_logits=True)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    mesh = DeviceMesh.of_shape((2,), ("cp",))
    got, want, ranks, ref, sent = train(model, mesh, (ids,), 2, loss_of=lambda out: out.loss, kwargs={"labels": ids})
    check_matches(got, want, ranks, ref, mesh)
    check_ring_ran_as_planned(ranks[0].last, sent, mesh)


def _pp_batches():
    cfg = moe.config("tiny", n_layer=4, batch=4)
    return [moe.example_tokens(cfg, seed=s) for s in range(2)]


def _pp_model():
    torch.manual_seed(0)
    return moe.MoEGPT(moe.config("tiny", n_layer=4, batch=4))


def _pp_worker(rank, world, init_method, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    model = nvtp.jit(_pp_model(), plan="megatron", mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)), microbatches=2)
    opt = torch.optim.SGD(model.module.parameters(), lr=0.1)
    losses = []
    for idx, targets in _pp_batches():
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    whole = model.full_parameters()
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "blocks": [list(s.blocks) for s in model.program.stages]}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_moe_gpt_on_pp2_trains_like_one_process_per_microbatch(tmp_path):
    """Two pipeline stages (2 MoE blocks each), 2 microbatches, 2 SGD steps. The load-balancing
    loss is a product of means, so a pipeline computes it per microbatch, as Megatron and
    torchtitan do: the eager reference is the mean of the microbatches' losses."""
    out = tmp_path / "got.pt"
    assert spawn(_pp_worker, 2, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    assert got["blocks"] == [[0, 1], [2, 3]]
    model = _pp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (idx, targets) in enumerate(_pp_batches()):
        loss = (model(idx[:2], targets[:2]) + model(idx[2:], targets[2:])) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(got["losses"][step] - loss.item()) <= 1e-5 * abs(loss.item()), (got["losses"], step, loss.item())
    for name, p in model.named_parameters():
        assert relative_error(got["params"][name], p.detach())[0] <= 1e-5, name


@pytest.mark.slow
def test_nvtp_explain_on_an_moe_model_prints_its_moe_layers():
    """The CLI as typed: ``nvtp explain --module nvtp.models.moe:tiny --plan megatron --devices 2``."""
    run = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--module", "nvtp.models.moe:tiny", "--plan", "megatron",
                          "--devices", "2"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "MoE: 4 experts, top-2, 64 routed rows (32 tokens x 2); expert weights w_fc tp S(2), w_proj tp S(1)" in run.stdout, run.stdout


class _RouterOps(torch.nn.Module):
    """What MoE code around the experts does that nvtp writes with its own ops: interleaved
    gate|up halves (``x[..., ::2]``: its gradient pads with holes, which nvFuser's pad lacks),
    per-expert biases looked up by expert (``b[index]``: an index_add gradient), a group mask
    written by ``scatter_`` and read through ``.bool()`` (DeepSeek-V3's router), top-k. (Thunder's
    own route fails on the in-place ``scatter_`` of a new tensor, 0.2.6: it gets ``scatter``.)"""

    def __init__(self, in_place: bool):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4, 8))
        self.in_place = in_place

    def forward(self, x, index):
        gate, up = x[..., ::2], x[..., 1::2]  # (N, 8) each
        y = torch.sigmoid(gate) * up + self.bias[index]  # (N, 8)
        zeros = torch.zeros_like(x[:, :4])
        mask = zeros.scatter_(1, index.unsqueeze(1), 1) if self.in_place else zeros.scatter(1, index.unsqueeze(1), 1)
        values, _ = torch.topk(y.masked_fill(~mask.bool()[:, :1], 0.0), 3, dim=-1)
        return values.square().sum()


@pytest.mark.parametrize("frontend", ["fx", "thunder"])
def test_router_and_expert_ops_around_the_experts_trace_and_match_eager(frontend):
    torch.manual_seed(0)
    model = _RouterOps(in_place=frontend == "fx")
    x, index = torch.randn(6, 16), torch.tensor([0, 3, 1, 3, 3, 0])
    want_x = x.clone().requires_grad_(True)
    ref = copy.deepcopy(model)
    want = ref(want_x, index)
    want.backward()
    got_x = x.clone().requires_grad_(True)
    got = nvtp.jit(model, plan="megatron", frontend=frontend)(got_x, index)
    got.backward()
    assert relative_error(got.detach(), want.detach())[0] <= 1e-6
    assert relative_error(got_x.grad, want_x.grad)[0] <= 1e-6
    assert relative_error(model.bias.grad, ref.bias.grad)[0] <= 1e-6
    assert model.bias.grad[2].abs().max() == 0  # no row chose expert 2


@pytest.mark.slow
def test_gpt_oss_at_tp2_matches_eager():
    """gpt-oss's experts: transposed weights ([E, in, out]), biases, gate and up interleaved and
    clamped (its own ``_apply_gate``); attention sinks and a sliding window around them."""
    model = build("gpt_oss")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    check_parity(model, Mesh(model, 2, "megatron", ids, labels=ids), ids)


def test_a_dump_of_gather_mm_carries_nvtps_class_and_only_it():
    """A printed ``gather_mm`` is ``nvtp_ops.gather_mm(fd, ...)`` with the class that writes it in
    nvFuser's ops; nvfuser_direct builds the text; a changed class is refused, naming it."""
    from nvtp.execute import nvfuser
    from nvtp.ir.parser import DumpError, parse
    from nvtp.ir.printer import format_file
    from tests.op_samples import SAMPLES_BY_NAME

    fusion = SAMPLES_BY_NAME["gather_mm"].build()
    text = format_file(fusion)
    assert "T3 = nvtp_ops.gather_mm(fd, T0, T1, T2)" in text and "class nvtp_ops:" in text
    assert parse(text).fusion == fusion
    assert nvfuser.compare_definition(fusion, nvfuser.build_from_text(text)) == []
    changed = text.replace("descending=False, stable=True)", "descending=True, stable=True)", 1)
    with pytest.raises(DumpError, match=r"class nvtp_ops differs from nvtp's \(nvtp/ir/composites.py\); a dump may hold it only verbatim"):
        parse(changed)
    assert "class nvtp_ops" not in format_file(SAMPLES_BY_NAME["topk"].build())


class _InPlaceRouter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        weights, _ = torch.topk(torch.softmax(self.gate(x), -1), 2, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)  # as Mixtral's and gpt-fast's routers write it
        return weights.sum()


def test_an_in_place_router_update_on_the_thunder_route_names_its_line_and_the_fix():
    with pytest.raises(nvtp.frontend.capture.CaptureError, match=r"copy_ .* at .*test_moe.py:\d+ `weights /= weights.sum.*"
                       r"write the in-place update out of place"):
        nvtp.jit(_InPlaceRouter(), plan="megatron", frontend="thunder")(torch.randn(6, 8))
    x = torch.randn(6, 8)
    model = _InPlaceRouter()
    want = copy.deepcopy(model)(x)
    assert relative_error(nvtp.jit(model, plan="megatron", frontend="fx")(x).detach(), want.detach())[0] <= 1e-6
