"""``tools/calibrate.py``: the ``cpu-gloo`` machine fitted from measurements and its entry rewritten,
and the cost model's terms it fits (``Machine.op_overhead``, ``Machine.kind_latency``)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Op, TensorValue
from nvtp.sharding import cost
from nvtp.sharding.placements import DeviceMesh

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "tools" / "calibrate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


TRUE = {"op_overhead": 9e-6, "memory": 5e9, "flops": 30e9, "bandwidth": 0.5e9,
        "latency": {("allreduce", 2): 2e-3, ("allreduce", 4): 4e-3, ("allgather", 2): 1.5e-3, ("allgather", 4): 3e-3,
                    ("reduce_scatter", 2): 2.5e-3, ("reduce_scatter", 4): 20e-3}}


def _measurements(tool) -> list[dict]:
    """What ``_worker`` would measure on 4 processes if the host were exactly ``TRUE`` (every rank alike)."""
    t = TRUE
    add = [(n * 4, t["op_overhead"] + n * 4 / t["memory"]) for n in tool.ADD_SIZES]
    linear = [(2 * m * k * n, m * n * 4, t["op_overhead"] + 2 * m * k * n / t["flops"]) for m, k, n in tool.LINEAR_SHAPES]
    collectives = [(kind, e * 4, size, t["latency"][kind, size] + tool.sent_bytes(kind, e * 4, size) / t["bandwidth"])
                   for size in (2, 4) for kind in tool.KINDS for e in tool.COLLECTIVE_SIZES]
    return [{"world": 4, "add": add, "linear": linear, "collectives": collectives, "per_rank": [(add, linear)] * 4}]


def test_the_fit_recovers_the_constants_the_measurements_came_from():
    tool = _tool()
    m = tool.fit(_measurements(tool), devices=4)
    for key in ("op_overhead", "memory", "flops", "bandwidth"):
        assert m[key] == pytest.approx(TRUE[key], rel=1e-6), key
    assert m["kind_latency"] == pytest.approx(TRUE["latency"], rel=1e-6)


def test_the_rewritten_entry_is_the_fitted_machine_and_nothing_else_changes():
    tool = _tool()
    m = tool.fit(_measurements(tool), devices=4)
    source = (ROOT / "nvtp" / "sharding" / "cost.py").read_text()
    new = tool.rewrite(source, tool.entry(m, (1.0, 2.0), 4))
    namespace: dict = {}
    exec(compile(ast.parse(new), "cost.py", "exec"), namespace)  # the rewritten module runs, and defines the fitted machine
    gloo = namespace["MACHINES"]["cpu-gloo"]
    assert gloo.flops == pytest.approx(TRUE["flops"], rel=1e-3) and gloo.op_overhead == pytest.approx(TRUE["op_overhead"], rel=1e-3)
    assert gloo.intra[0] == pytest.approx(TRUE["bandwidth"], rel=1e-3)
    assert {(k, n): s for k, n, s in gloo.kind_latency} == pytest.approx(TRUE["latency"], rel=1e-3)
    assert "calibrated by tools/calibrate.py" in gloo.describe
    for name in ("h100-nvlink", "h100-ib"):  # the other machines as they were
        assert asdict(namespace["MACHINES"][name]) == asdict(cost.MACHINES[name])
    assert tool.rewrite(new, tool.entry(m, (1.0, 2.0), 4)) == new  # rewriting again finds the entry it wrote


def test_a_collective_costs_the_latency_measured_for_its_kind_and_ranks_and_every_op_the_overhead():
    machine = replace(cost.MACHINES["cpu-gloo"], intra=(1e9, 1e-3), inter=(1e9, 1e-3), op_overhead=7e-6,
                      kind_latency=(("reduce_scatter", 4, 20e-3),))
    mesh4, mesh2 = DeviceMesh.of_size(4), DeviceMesh.of_size(2)
    assert machine.collective_seconds(mesh4, 0, "reduce_scatter", 1e6) == pytest.approx(20e-3 + 1e-3)
    assert machine.collective_seconds(mesh2, 0, "reduce_scatter", 1e6) == pytest.approx(1e-3 + 1e-3)  # not measured on 2: the link's
    assert machine.collective_seconds(mesh4, 0, "allreduce", 1e6) == pytest.approx(1e-3 + 1e-3)
    a, b, out = (TensorValue(n, (1000,), DType.Float) for n in ("T0", "T1", "T2"))
    add = Op("add", (("lhs", a), ("rhs", b)), (out,))  # an elementwise op writing 1000 fp32 values
    assert cost.op_seconds(add, machine, lambda v: v.shape) == pytest.approx(7e-6 + 4000 / machine.memory)


@pytest.mark.slow
def test_the_tool_as_typed_measures_this_host_and_prints_an_entry(tmp_path):
    """On 2 and 4 gloo processes, one repeat, --dry-run: exit 0, an entry that parses, cost.py unchanged (about 30 s)."""
    before = (ROOT / "nvtp" / "sharding" / "cost.py").read_text()
    out = subprocess.run([sys.executable, "tools/calibrate.py", "--dry-run", "--repeat", "1", "--out", str(tmp_path / "c.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    call = ast.parse(out.stdout[out.stdout.index('Machine("cpu-gloo"'):].strip()).body[0].value  # the last thing printed
    assert {k.arg for k in call.keywords} >= {"flops", "memory", "intra", "op_overhead", "kind_latency"}
    assert (ROOT / "nvtp" / "sharding" / "cost.py").read_text() == before


def test_a_microbatch_product_costs_its_share_of_the_flops():
    """A linear of a microbatch's activations (factor 1/4: the planner's 4 microbatches) by a whole
    weight (factor 1) costs a quarter of the whole batch's FLOPs; a batch 4x larger, 4x."""
    machine = cost.MACHINES["h100-ib"]
    x, w, y = TensorValue("X", (64, 128), DType.Float), TensorValue("W", (256, 128), DType.Float), TensorValue("Y", (64, 256), DType.Float)
    linear = Op("linear", (("input", x), ("weight", w)), (y,))
    whole = 2 * 64 * 128 * 256 / machine.flops
    for f in (0.25, 4.0):
        got = cost.op_seconds(linear, machine, lambda v: v.shape, lambda name, f=f: f if name in ("X", "Y") else 1.0)
        assert got == pytest.approx(f * whole)
