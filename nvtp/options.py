"""Every option of nvtp's entry points, checked in one place, before any work.

    options.check("jit", module=model, mesh=mesh, microbatches=0)
    # OptionError: microbatches=0: give a positive number of microbatches per step (an int, e.g. microbatches=2)
    options.check("plan", mesh=(2, 2), schedule="gpipe")
    # OptionError: schedule='gpipe' is an option of the 'pp' mesh axis (a pipeline), and this mesh has axes dp, tp: ...

``nvtp.jit``, ``nvtp.plan``, ``nvtp.ShardingTransform`` and the command line (``check_cli``: each
command's flags named as the Python options they set) call ``check`` at their top, so plan and run
accept the same inputs, and no option is dropped: one that the chosen path does not honour is
refused, saying why and what to do. The knowledge is in four tables:

* ``RULES``: each option's type and values, and its default (what every path does anyway: an
  option counts as given when it differs from its default);
* ``ENTRIES``: the options each entry point takes;
* ``AXIS_OPTIONS``: the options each mesh axis takes: an option listed there is refused on a mesh
  without that axis (``schedule=`` without "pp", ``fsdp=True`` without "dp");
* ``AXIS_REFUSES``: the options a mesh with that axis does not honour, with why and what to do.

The last two are plain data keyed by axis name, to move into each axis's strategy. This module
imports no torch (the command line refuses bad flags before torch loads); the few tables a rule
reads from torch-side modules (schedules, machines, routes) are read when the rule runs.
"""

from __future__ import annotations

import math
import inspect
from typing import Any, Callable, Mapping

from nvtp.errors import InputError
from nvtp.execute.backends import CHOICES as BACKEND_CHOICES


class OptionError(InputError):
    """An option of the wrong type or value, or one the chosen mesh or path does not honour;
    says which, why, and what to pass instead (bad input: refused before any work)."""


# ---------------------------------------------------------------------------------------------
# rules: each option's type and values


def _bool(name: str, value: Any) -> str | None:
    if not isinstance(value, bool):
        return f"{name}={value!r}: pass True or False"
    return None


def _positive_int(example: int) -> Callable[[str, Any], str | None]:
    def rule(name: str, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r}: give a positive whole number (e.g. {name}={example})"
        return None

    return rule


def _timeout(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return f"{name}={value!r}: give the seconds a rank waits for a silent peer, a number more than 0 (e.g. {name}=60), or None for no watchdog"
    return None


def _one_of(choices: Callable[[], tuple[str, ...]], normal: Callable[[str], str] = lambda s: s) -> Callable[[str, Any], str | None]:
    def rule(name: str, value: Any) -> str | None:
        names = choices()
        if value is not None and (not isinstance(value, str) or normal(value) not in names):
            return f"{name}={value!r}: choose one of {', '.join(map(repr, names))}"
        return None

    return rule


def _schedules() -> tuple[str, ...]:
    from nvtp.pipeline.schedule import SCHEDULES

    return SCHEDULES


def _routes() -> tuple[str, ...]:
    from nvtp.driver import ROUTES

    return ROUTES


def _backend(name: str, value: Any) -> str | None:
    if isinstance(value, str) and value in BACKEND_CHOICES:
        return None
    return f"unknown backend {value!r}; choose one of {', '.join(map(repr, BACKEND_CHOICES))}"  # nvtp.execute.backends' words


def _plan(name: str, value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return None
    if isinstance(value, Mapping) and value:
        return None
    return (f"{name}={value!r}: give a plan's name ('megatron', 'megatron-sp', 'replicate') or an explicit plan: "
            "'glob=placement;...' or a dict {glob: placement}")


def _collective_matmul(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or value == "auto" and isinstance(value, str):
        return None
    return f"{name}={value!r}: pass True (wherever it applies), False (never) or 'auto' (where the cost model says it pays)"


def _machine(name: str, value: Any) -> str | None:
    from nvtp.sharding.overlap import MACHINES, Machine

    if value is None or isinstance(value, Machine) or (isinstance(value, str) and value in MACHINES):
        return None
    return f"{name}={value!r}: give a machine's name ({', '.join(map(repr, MACHINES))}) or an nvtp.sharding.overlap.Machine"


def _cut(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        return None
    hint = f" (cut=[{value}])" if isinstance(value, int) and not isinstance(value, bool) else ""
    return (f"{name}={value!r}: give the first block of each stage after the first, a list of whole numbers{hint}; "
            "e.g. cut=[2] cuts 4 blocks into stages [0, 2) and [2, 4)")


def _comm(name: str, value: Any) -> str | None:
    if value is None or (hasattr(value, "rank") and hasattr(value, "size")):
        return None
    return f"{name}={value!r}: give a simulated mesh's communicator for this rank (nvtp.execute.collectives), or None"


# option -> (rule, default)
RULES: dict[str, tuple[Callable[[str, Any], str | None], Any]] = {
    "plan": (_plan, "megatron"),
    "mesh": (lambda name, value: None, None),  # built and checked by nvtp.mesh.make_mesh / nvtp.pipeline.layout
    "devices": (_positive_int(2), None),
    "comm": (_comm, None),
    "dynamic": (_bool, False),
    "timeout": (_timeout, 60.0),
    "check_replicas": (_bool, False),
    "frontend": (_one_of(_routes), "auto"),
    "fsdp": (_bool, False),
    "regional": (_bool, True),
    "backend": (_backend, "auto"),
    "overlap": (_bool, True),
    "collective_matmul": (_collective_matmul, "auto"),
    "machine": (_machine, None),
    "microbatches": (_positive_int(2), None),
    "schedule": (_one_of(_schedules, lambda s: s.lower().replace("-", "")), None),
    "cut": (_cut, None),
}

# The options each entry point takes (the command line's commands: their flags, named as these).
ENTRIES: dict[str, frozenset[str]] = {
    "jit": frozenset({"plan", "mesh", "comm", "dynamic", "timeout", "check_replicas", "frontend", "fsdp", "regional", "backend",
                      "overlap", "collective_matmul", "microbatches", "schedule", "cut"}),
    "plan": frozenset({"plan", "mesh", "devices", "backend", "fsdp", "regional", "machine", "collective_matmul", "microbatches",
                       "schedule", "cut"}),
    "transform": frozenset({"plan", "mesh", "comm", "backend", "regional", "timeout"}),
    "explain": frozenset({"plan", "mesh", "devices", "backend", "fsdp", "machine", "collective_matmul", "microbatches", "schedule"}),
    "shard": frozenset({"plan", "mesh", "devices", "fsdp"}),
    "replay": frozenset({"plan", "mesh", "devices", "fsdp", "timeout", "backend"}),
    "demo": frozenset({"plan", "mesh", "devices", "fsdp", "timeout", "microbatches", "schedule"}),
}

# The options each mesh axis takes: refused on a mesh without that axis.
AXIS_OPTIONS: dict[str, frozenset[str]] = {
    "tp": frozenset(),
    "dp": frozenset({"fsdp"}),
    "cp": frozenset(),
    "pp": frozenset({"microbatches", "schedule", "cut"}),
}

# The options a mesh with this axis does not honour: why, and what to do instead.
AXIS_REFUSES: dict[str, dict[str, str]] = {
    "pp": {
        "fsdp": "a pipeline's dp axis is DDP-style (each stage's weights whole over dp); shard without a 'pp' axis for FSDP",
        "comm": "a pipeline runs on torch.distributed's processes, not a simulated mesh; call it in processes after "
                "torch.distributed.init_process_group",
        "dynamic": "a pipeline is compiled for one batch shape, cut into microbatches; pass the same shapes every step, or shard "
                   "without a 'pp' axis to compile each new shape",
        "check_replicas": "a pipeline does not compare replicated inputs across ranks; leave it out, or check without a 'pp' axis",
        "regional": "a pipeline traces a chain of repeated blocks once and splices it, as its stages are cut at block boundaries; "
                    "leave regional at its default",
        "overlap": "a pipeline's stages start each collective as soon as its input exists (the default schedule); leave overlap "
                   "at its default, or shard without a 'pp' axis to run each collective where it stands",
        "collective_matmul": "a pipeline's stages plan collective matmuls where the cost model says they pay (the default, "
                             "'auto'); leave it at its default, or shard without a 'pp' axis to force it on or off",
        "machine": "a pipeline's report does not estimate overlap on a machine model; leave machine out",
    },
}

_EXAMPLES = {  # how to make a mesh with the axis, for the messages
    "pp": "init_device_mesh(device, (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp')) (on the command line --mesh PPxDPxTP)",
    "dp": "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')) (on the command line --mesh DPxTP)",
    "cp": "init_device_mesh(device, (cp,), mesh_dim_names=('cp',)) (on the command line --mesh cp=N)",
    "tp": "a number of devices, or init_device_mesh(device, (tp,), mesh_dim_names=('tp',))",
}
_CLI_EXAMPLES = {"pp": "--mesh PPxDPxTP (e.g. --mesh 2x1x2)", "dp": "--mesh DPxTP (e.g. --mesh 2x2)", "cp": "--mesh cp=N",
                 "tp": "--devices N"}
_WHAT = {"pp": "a pipeline", "dp": "data parallelism", "cp": "context parallelism", "tp": "tensor parallelism"}


# ---------------------------------------------------------------------------------------------
# the check


def mesh_axes(mesh: Any) -> tuple[str, ...]:
    """The axis names of anything ``nvtp.jit`` / ``nvtp.plan`` / the command line take as a mesh,
    without building it (None: "tp"); () when the spelling is not one nvtp knows (the mesh's own
    check then refuses it)."""
    if mesh is None or (isinstance(mesh, int) and not isinstance(mesh, bool)):
        return ("tp",)
    if isinstance(mesh, str):
        text = mesh.replace(" ", "").lower()
        if "=" in text:
            return tuple(part.partition("=")[0] for part in text.split(","))
        return {1: ("tp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}.get(text.count("x") + 1, ())
    if isinstance(mesh, (tuple, list)):
        return {2: ("dp", "tp"), 3: ("pp", "dp", "tp")}.get(len(mesh), ())
    if all(hasattr(mesh, a) for a in ("pp", "dp", "tp")):  # nvtp.pipeline.layout.Layout
        return ("pp", "dp", "tp")
    names = getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "names", None)
    if names:
        return tuple(names)
    return ("tp",) if getattr(mesh, "ndim", None) == 1 else ()


def given(name: str, value: Any) -> bool:
    """Whether ``value`` differs from what ``name`` does by default (so a path must honour it)."""
    default = RULES[name][1]
    return not (value is default or (type(value) is type(default) and value == default))


def check(entry: str, *, module: Any = None, **options: Any) -> None:
    """Refuse (``OptionError``) an option of the wrong type or value, one ``entry`` does not take,
    one that needs a mesh axis the mesh lacks, and one the mesh's path does not honour. With
    ``module`` (a pipeline's), ``cut`` is checked against its blocks too. Touches nothing."""
    takes = ENTRIES[entry]
    for name, value in options.items():
        if name not in takes and entry in _PYTHON:
            raise OptionError(f"{_caller(entry)} takes no option {name}=; it takes {', '.join(sorted(takes))}")
        if name not in takes and given(name, value):
            raise OptionError(f"{_spelled(entry, name, value)} does not apply to nvtp {entry}; it takes "
                              f"{', '.join(sorted(_flag(entry, n) for n in takes))}")
        if not given(name, value):
            continue
        problem = RULES[name][0](name, value)
        if problem is not None:
            raise OptionError(problem)
    axes = mesh_axes(options.get("mesh"))
    if entry in _PYTHON and options.get("mesh") is not None and options.get("devices") is not None:  # the CLI's own check words it
        raise OptionError(f"devices={options['devices']} and mesh={options['mesh']!r} both say which mesh: give one of them")
    for name, value in options.items():
        if not given(name, value):
            continue
        for axis, wanted in AXIS_OPTIONS.items():
            if name in wanted and axis not in axes:
                example = _EXAMPLES[axis] if entry in _PYTHON else _CLI_EXAMPLES[axis]
                raise OptionError(f"{_spelled(entry, name, value)} is an option of the {axis!r} mesh axis ({_WHAT[axis]}), and "
                                  f"this mesh has {_axes_text(axes)}: give a mesh with a {axis!r} axis, {example}, or "
                                  f"leave {_flag(entry, name)} out")
        for axis in axes:
            why = AXIS_REFUSES.get(axis, {}).get(name)
            if why is not None:
                raise OptionError(f"{_spelled(entry, name, value)} is not honoured on a mesh with a {axis!r} axis: {why}")
    if "pp" in axes and given("cut", options.get("cut")) and module is not None:
        check_cut(options["cut"], _blocks(module), _pp_size(options.get("mesh")))


def pipeline_options(model: Any, example_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The pipeline's options among ``nvtp.plan``'s keywords (the others are the model's example
    keywords): ``microbatches``, ``schedule``, ``cut``, unless the model's forward takes that name."""
    try:
        takes = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        takes = set()
    return {k: example_kwargs[k] for k in AXIS_OPTIONS["pp"] if k in example_kwargs and k not in takes}


def check_cut(cut: Any, blocks: tuple[str, int] | None, stages: int | None) -> None:
    """Refuse a ``cut`` that does not make ``stages`` stages of the model's ``blocks`` ((the
    ModuleList's name, its length); None when unknown), before anything is traced."""
    problem = _cut("cut", cut)
    if problem is not None:
        raise OptionError(problem)
    if blocks is None or stages is None:
        return
    prefix, count = blocks
    cuts = list(cut)
    if len(cuts) != stages - 1 or cuts != sorted(set(cuts)) or (cuts and (cuts[0] < 1 or cuts[-1] >= count)):
        even = [count * (i + 1) // stages for i in range(stages - 1)]
        raise OptionError(f"cut={cuts}: the model has {count} blocks ({prefix}.0 .. {prefix}.{count - 1}) and the mesh pp={stages} "
                          f"stages: give the first block of each stage after the first, {stages - 1} increasing number(s) in "
                          f"1..{count - 1} (e.g. cut={even}), or leave cut out for the balanced cut")


def _blocks(module: Any) -> tuple[str, int] | None:
    from nvtp.frontend.regional import NotRepeatable, find_repeated

    try:
        rep = find_repeated(module)
    except NotRepeatable:
        return None  # the pipeline's own check says why it has no blocks to cut at
    return rep.prefix, rep.count


def _pp_size(mesh: Any) -> int | None:
    if isinstance(mesh, str):
        return int(mesh.lower().split("x")[0]) if mesh.lower().split("x")[0].strip().isdigit() else None
    if isinstance(mesh, (tuple, list)):
        return mesh[0] if isinstance(mesh[0], int) else None
    if hasattr(mesh, "pp") and isinstance(mesh.pp, int):
        return mesh.pp
    names = tuple(getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "names", None) or ())
    shape = tuple(getattr(mesh, "shape", ()))
    return int(shape[names.index("pp")]) if "pp" in names and len(shape) == len(names) else None


# ---------------------------------------------------------------------------------------------
# the command line: flags as options


_CLI_FLAGS = {"plan": "--plan", "mesh": "--mesh", "devices": "--devices", "fsdp": "--fsdp", "timeout": "--timeout",
              "backend": "--backend", "machine": "--machine", "collective_matmul": "--collective-matmul",
              "microbatches": "--microbatches", "schedule": "--schedule"}
_CLI_VALUES = {"collective_matmul": {"auto": "auto", "on": True, "off": False}}


def check_cli(args: Any) -> None:
    """The command line's flags of ``args.command`` (argparse's namespace) checked as the options
    they set, by ``check``: e.g. ``nvtp explain --mesh 2x2 --microbatches 4`` is refused as
    ``microbatches=4`` without a 'pp' axis is."""
    command = getattr(args, "command", None)
    if command not in ENTRIES:
        return
    options = {}
    for name in RULES:  # every flag that sets an option, so one the command does not use is refused, not ignored
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        value = _CLI_VALUES.get(name, {}).get(value, value) if isinstance(value, str) else value
        if name == "timeout" and value == 60.0:
            continue  # the flag's default, the same as the option's
        if name == "backend" and command in ("replay",) and value == "reference":
            continue  # replay's default backend
        if value is not None or name in ("plan",):
            options[name] = value
    if options.get("plan") is None:
        options.pop("plan", None)
    if command == "replay" and "timeout" in options and not (options.get("plan") or (options.get("devices") or 1) > 1
                                                             or options.get("mesh")):
        raise OptionError(f"--timeout {options['timeout']:g} bounds the wait for a silent rank of a mesh of processes, and this "
                          "replay runs in one process: add --devices N (or --mesh, --plan) to replay on a mesh, or leave "
                          "--timeout out")
    check(command, **options)


# ---------------------------------------------------------------------------------------------
# wording


_PYTHON = ("jit", "plan", "transform")


def _caller(entry: str) -> str:
    return {"jit": "nvtp.jit", "plan": "nvtp.plan", "transform": "nvtp.ShardingTransform"}.get(entry, f"nvtp {entry}")


def _flag(entry: str, name: str) -> str:
    if entry in _PYTHON:
        return f"{name}="
    return _CLI_FLAGS.get(name, "--" + name.replace("_", "-"))


def _spelled(entry: str, name: str, value: Any) -> str:
    if entry in _PYTHON:
        return f"{name}={value!r}"
    flag = _CLI_FLAGS.get(name, "--" + name.replace("_", "-"))
    typed = next((k for k, v in _CLI_VALUES.get(name, {}).items() if v is value), None)
    if typed is not None:
        return f"{flag} {typed}"
    if isinstance(value, bool):
        return flag
    return f"{flag} {value}"


def _axes_text(axes: tuple[str, ...]) -> str:
    return f"axes {', '.join(axes)}" if len(axes) > 1 else f"the axis {axes[0]}" if axes else "no named axes"


__all__ = ["OptionError", "RULES", "ENTRIES", "AXIS_OPTIONS", "AXIS_REFUSES", "check", "check_cut", "check_cli", "given",
           "mesh_axes", "pipeline_options"]
