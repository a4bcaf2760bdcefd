"""The one writer of a Program's files for nvFuser: every rank's fusions, in one sequence.

    paths = write_program(program, "out/")   # out/program_fwd.py, out/program_bwd.py, and a file per ring step

Each phase of the program, in order: its sharded fusion with its device schedule
(``set_device_mesh``, splits, ``ParallelType.mesh_x``) and its resharding ``set`` ops; then, for
each kind of ring among the program's steps (``Program.steps()``), the fusion one step of it
runs on a rank: a collective matmul as nvFuser's stream-parallel schedule writes it
(``nvtp.sharding.collective_matmul.collective_matmul_fusions``), and a ring attention's block and
merge (``nvtp.sharding.axes.ring.ring_step_fusions``; nvFuser has no point-to-point step inside a
fusion, so the host passes the blocks between these). The builders make the fusions; this module
alone prints them. nvfuser_direct builds every file from its text (tests/test_nvfuser_text.py).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from nvtp.dump.sharded import write_sharded
from nvtp.ir.printer import format_file, format_schedule
from nvtp.sharding import axes
from nvtp.sharding.axes.ring import ring_step_fusions
from nvtp.sharding.collective_matmul import collective_matmul_fusions
from nvtp.sharding.schedule import ScheduleError

SHORT = {"forward": "fwd", "backward": "bwd"}


def write_program(program, directory: str | os.PathLike, name: str = "program") -> list[Path]:
    """``program``'s files in ``directory``, in one sequence (see the module docstring)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    data = axes.data_mode(program.fsdp) if program.mesh.ndim > 1 else None
    command = f"nvtp.jit(model, plan={program.plan!r}, backend={program.backend!r}).lower(*args).write_nvfuser({str(directory)!r})"
    steps = program.steps(communication_only=True)
    for phase, sharded in program.phases():
        try:
            paths.append(write_sharded(sharded, out / f"{name}_{SHORT[phase]}.py", command, data=data))
        except ScheduleError as e:
            if program.backend == "nvfuser":
                raise
            raise ScheduleError(f"this program was sharded for the {program.backend} backend's target, whose placements "
                                f"nvFuser's device schedule cannot always express ({e}); write the program nvFuser would run: "
                                "nvtp.plan(..., backend='nvfuser') or nvtp.driver.compile(..., backend='nvfuser')") from e
    if any(s.kind == "sendrecv" and not s.ring and s.phase == "forward" for s in steps):  # a ring attention: one step's fusions
        paths += _ring_attention_steps(program.forward, out, name)
    for phase, sharded in program.phases():
        if any(s.ring and s.phase == phase for s in steps):  # collective matmuls
            paths += _collective_matmuls(sharded, list(program.schedules[phase].rings), out, f"{name}_{SHORT[phase]}")
    return paths


def _collective_matmuls(sharded, rings, directory: Path, stem: str) -> list[Path]:
    """A collective matmul of each kind: its product with the rows split over streams beside the device split."""
    paths = []
    for step, fusion, schedule in collective_matmul_fusions(sharded, rings):
        fusion = replace(fusion, attrs={"devices": str(rings[0].steps + 1), "inputs": "per rank"})
        path = directory / f"{stem}_{step}.py"
        shapes = {v.name: list(v.shape) for v in fusion.inputs}  # each device passes its part
        split_over_devices = {(t.tensor, t.args) for t in schedule if t.kind == "parallelize"}
        for st in schedule:
            if st.kind == "split" and st.tensor in shapes and (st.tensor, (st.args[0], "mesh_x")) in split_over_devices:
                shapes[st.tensor][st.args[0]] //= st.args[1]
        header = [f"nvtp's collective matmul ({step.split('_')[-1]}) on one {sharded.mesh.names[rings[0].axis]} group of "
                  f"{rings[0].steps + 1} devices, as nvFuser's multidevice schedule expresses it: the product's rows split over",
                  "streams (ParallelType.stream) beside the device split, so each block's communication overlaps another block's",
                  "matmul. Shapes are the whole group's; written by nvtp.dump.program_files."]
        path.write_text(format_file(fusion, header=header, extra_imports=["import nvfuser_direct", "from nvfuser_direct import ParallelType"],
                                    extra_body=format_schedule(schedule), input_shapes=shapes, device="cuda"))
        paths.append(path)
    return paths


def _ring_attention_steps(sharded, directory: Path, name: str) -> list[Path]:
    """One ring attention step on a rank: attention on the K/V block at hand, merged by log-sum-exp."""
    paths = []
    mesh = sharded.mesh
    for step, fusion in ring_step_fusions(sharded):
        path = directory / f"{name}_{step}.py"
        header = [f"One step of nvtp's ring attention on one rank of the cp axis ({'x'.join(map(str, mesh.shape))} mesh, "
                  f"{dict(zip(mesh.names, mesh.shape))}): attention of the local queries on one K/V block,",
                  "merged with the running output by log-sum-exp. The host passes the K/V blocks between steps (torch.distributed).",
                  "Written by nvtp.dump.program_files."]
        path.write_text(format_file(fusion, header=header))
        paths.append(path)
    return paths


__all__ = ["write_program"]
