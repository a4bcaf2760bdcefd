"""Every option of nvtp's entry points, checked in one place, before any work.

    options.check("jit", module=model, mesh=mesh, microbatches=0)
    # OptionError: microbatches=0: give a positive whole number (e.g. microbatches=2)
    options.check("plan", mesh=(2, 2), schedule="gpipe")
    # OptionError: schedule='gpipe' is an option of the 'pp' mesh axis (pipeline parallel: ...), and this mesh has axes dp, tp: ...

``nvtp.jit``, ``nvtp.plan``, ``nvtp.ShardingTransform`` and the command line (``check_cli``: each
command's flags named as the Python options they set) call ``check`` at their top with every
option they take, so plan and run accept the same inputs, and no option is dropped: one that the
chosen path does not honour is refused, saying why and what to do. The knowledge is in tables:

* ``RULES``: each option's type and values, and its default (what every path does anyway: an
  option counts as given when it differs from its default);
* ``COMMANDS``: the flags each command of the command line takes;
* from each mesh axis's strategy (``nvtp.sharding.axes``): ``Strategy.options``, the options only
  that axis takes (refused on a mesh without it: ``schedule=`` without a pipeline axis), and
  ``Strategy.refuses``, the options a mesh with that axis does not honour, with why and what to do.

This module imports no torch until an option needs a mesh's strategies (the command line refuses
its other bad flags before torch loads).
"""

from __future__ import annotations

import math
import inspect
from typing import Any, Callable, Mapping

from nvtp.errors import InputError
from nvtp.execute.backends import CHOICES as BACKEND_CHOICES
from nvtp.sharding import axes


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
    from nvtp.pipeline.schedule import SCHEDULES  # lazy: kept off nvtp --help's path

    return SCHEDULES


def _recompute_modes() -> tuple[str, ...]:
    from nvtp.frontend.recompute import MODES  # lazy: kept off nvtp --help's path

    return MODES


def _memory(name: str, value: Any) -> str | None:
    """A budget per device for plan='auto' (bytes, or a size such as '80GB'; nvtp.auto.search.parse_memory reads it)."""
    if value is None or isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        return None
    return f"{name}={value!r}: give plan='auto' a memory budget per device, in bytes or as a size such as '80GB'"


def _routes() -> tuple[str, ...]:
    from nvtp.driver import ROUTES  # lazy: loads Thunder; CLI file commands load this module without it

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
    from nvtp.sharding.cost import MACHINES, Machine  # lazy: kept off nvtp --help's path

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


def _verify(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or (isinstance(value, (int, float)) and 0 < value < 1):
        return None
    return (f"{name}={value!r}: give True (check the first call against eager PyTorch), False (skip the check), "
            "or a relative tolerance between 0 and 1 (e.g. 1e-2)")


def _capacity_factor(name: str, value: Any) -> str | None:
    """ep's capacity factor (``nvtp.sharding.axes.ep``): a finite number more than 0, or None (dropless)."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf):
        return None
    return (f"{name}={value!r}: give each expert's capacity as a multiple of an even share of a rank's routed tokens, a "
            f"number more than 0 (e.g. {name}=1.25: each expert takes at most ceil(1.25 x tokens x top_k / experts) of a "
            "rank's tokens, the rest dropped), or leave it out to drop none")


def _compile(name: str, value: Any) -> str | None:
    from nvtp.execute.kernels import mode_problem  # imports torch: only for a compile= that is given

    return mode_problem(name, value)


# option -> (rule, default), written as the entry points' keywords
RULES: dict[str, tuple[Callable[[str, Any], str | None], Any]] = dict(
    plan=(_plan, "megatron"),
    mesh=(lambda name, value: None, None),  # built and checked by nvtp.mesh.make_mesh and the pipeline's layout
    devices=(_positive_int(2), None),
    comm=(_comm, None),
    dynamic=(_bool, False),
    timeout=(_timeout, 60.0),
    check_replicas=(_bool, False),
    frontend=(_one_of(_routes), "auto"),
    fsdp=(_bool, False),
    regional=(_bool, True),
    backend=(_backend, "auto"),
    overlap=(_bool, True),
    collective_matmul=(_collective_matmul, "auto"),
    machine=(_machine, None),
    microbatches=(_positive_int(2), None),
    schedule=(_one_of(_schedules, lambda s: s.lower().replace("-", "")), None),
    cut=(_cut, None),
    verify=(_verify, True),
    compile=(_compile, "kernels"),  # nvtp.execute.kernels.DEFAULT
    recompute=(_one_of(_recompute_modes), "none"),
    memory=(_memory, None),
    capacity_factor=(_capacity_factor, None),
)

# Options no axis takes or refuses (a test holds it): a call giving only these needs no mesh strategy.
MESH_FREE = frozenset({"plan", "mesh", "devices", "backend", "timeout", "verify", "compile", "recompute", "memory"})

# The flags each command of the command line takes (each sets the option of its name).
COMMANDS: dict[str, tuple[str, ...]] = {
    "explain": ("--plan", "--mesh", "--devices", "--backend", "--fsdp", "--machine", "--collective-matmul", "--microbatches",
                "--schedule", "--memory", "--capacity-factor"),
    "shard": ("--plan", "--mesh", "--devices", "--fsdp"),
    "replay": ("--plan", "--mesh", "--devices", "--fsdp", "--timeout", "--backend"),
    "demo": ("--plan", "--mesh", "--devices", "--fsdp", "--timeout", "--microbatches", "--schedule"),
}


def axis_options() -> dict[str, frozenset[str]]:
    """Each mesh axis name -> the options only it takes (its strategy's ``options``)."""
    return {name: s.options for name, s in axes.AXES.items()}


def axis_refuses() -> dict[str, Mapping[str, str]]:
    """Each mesh axis name -> the options a mesh with it does not honour, and why (``refuses``)."""
    return {name: s.refuses for name, s in axes.AXES.items()}


def _option(flag: str) -> str:
    return flag[2:].replace("-", "_")


# ---------------------------------------------------------------------------------------------
# the check


def mesh_axes(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """The axis names (and sizes, when the spelling gives them) of anything ``nvtp.jit``,
    ``nvtp.plan`` or the command line take as a mesh, without building it; ((), None) when the
    spelling is not one nvtp knows (the mesh's own check then refuses it)."""
    if mesh is None or (isinstance(mesh, int) and not isinstance(mesh, bool)):
        return axes.spelled(1), None
    if isinstance(mesh, str):
        text = mesh.replace(" ", "").lower()
        if "=" in text:
            pairs = [part.partition("=") for part in text.split(",")]
            return tuple(n for n, _, _ in pairs), tuple(int(k) if k.isdigit() else 0 for _, _, k in pairs)
        parts = text.split("x")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            return (), None
        return axes.spelled(len(parts)), tuple(int(p) for p in parts)
    if isinstance(mesh, (tuple, list)):
        if not 1 <= len(mesh) <= 3:
            return (), None
        return axes.spelled(len(mesh)), tuple(mesh)
    if isinstance(mesh, axes.Layout):
        return axes.spelled(3), (mesh.pp, mesh.dp, mesh.tp)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "names", None) or ())
    shape = tuple(int(n) for n in getattr(mesh, "shape", ()))
    if not names and getattr(mesh, "ndim", None) == 1:
        names = axes.spelled(1)
    return names, (shape if len(shape) == len(names) else None)


def given(name: str, value: Any) -> bool:
    """Whether ``value`` differs from what ``name`` does by default (so a path must honour it)."""
    default = RULES[name][1]
    return not (value is default or (type(value) is type(default) and value == default))


def check(entry: str, *, module: Any = None, **options: Any) -> None:
    """Refuse (``OptionError``) an option of the wrong type or value, one that needs a mesh axis
    the mesh lacks, and one the mesh's path does not honour; ``entry`` ("jit", "plan",
    "transform", or a command of the command line) passes every option it takes. With ``module``
    (a pipeline's), ``cut`` is checked against its blocks too. Touches nothing."""
    for name, value in options.items():
        if name not in RULES:
            raise OptionError(f"{_caller(entry)} takes no option {name}=")
        if entry in COMMANDS and _flag(name) not in COMMANDS[entry] and given(name, value):
            raise OptionError(f"{_spelled(entry, name, value)} does not apply to nvtp {entry}; it takes "
                              f"{', '.join(sorted(COMMANDS[entry]))}")
        if not given(name, value):
            continue
        problem = RULES[name][0](name, value)
        if problem is not None:
            raise OptionError(problem)
    if entry not in COMMANDS and options.get("mesh") is not None and options.get("devices") is not None:  # the CLI's own check words it
        raise OptionError(f"devices={options['devices']} and mesh={options['mesh']!r} both say which mesh: give one of them")
    wanted = {name for name, value in options.items() if given(name, value)} - MESH_FREE
    if not wanted:
        return  # no option of this call depends on the mesh's axes: their strategies (and torch) are not needed
    refuses, takes = axis_refuses(), axis_options()
    names, sizes = mesh_axes(options.get("mesh"))
    for name in sorted(wanted):
        for axis, own in takes.items():
            if name in own and axis not in names:
                raise OptionError(f"{_spelled(entry, name, options[name])} is an option of the {axis!r} mesh axis "
                                  f"({_summary(axis)}), and this mesh has {_axes_text(names)}: give a mesh with a {axis!r} axis"
                                  f"{_example(entry, axis)}, or leave {_flag(name) if entry in COMMANDS else name + '='} out")
        for axis in names:
            why = refuses.get(axis, {}).get(name)
            if why is not None:
                raise OptionError(f"{_spelled(entry, name, options[name])} is not honoured on a mesh with a {axis!r} axis: {why}")
    if "cut" in wanted and module is not None:
        stages = _stages(names, sizes)
        check_cut(options["cut"], _blocks(module), stages)


def pipeline_options(model: Any, example_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a stage-cutting axis (a pipeline's ``microbatches``, ``schedule``, ``cut``)
    among ``nvtp.plan``'s keywords (the others are the model's example keywords), unless the
    model's forward takes that name."""
    try:
        takes = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        takes = set()
    own = set().union(*(s.options for s in axes.AXES.values() if s.cuts_stages))
    return {k: example_kwargs[k] for k in sorted(own) if k in example_kwargs and k not in takes}


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
        raise OptionError(f"cut={cuts}: the model has {count} blocks ({prefix}.0 .. {prefix}.{count - 1}) and the mesh {stages} "
                          f"pipeline stages: give the first block of each stage after the first, {stages - 1} increasing "
                          f"number(s) in 1..{count - 1} (e.g. cut={even}), or leave cut out for the balanced cut")


def _blocks(module: Any) -> tuple[str, int] | None:
    from nvtp.frontend.blocks import NotRepeatable, find_repeated  # lazy: kept off nvtp --help's path

    try:
        rep = find_repeated(module)
    except NotRepeatable:
        return None  # the pipeline's own check says why it has no blocks to cut at
    return rep.prefix, rep.count


def _stages(names: tuple[str, ...], sizes: tuple[int, ...] | None) -> int | None:
    """The extent of the axis that cuts stages, when the mesh's spelling gives it."""
    at = next((i for i, n in enumerate(names) if n in axes.AXES and axes.AXES[n].cuts_stages), None)
    return None if at is None or sizes is None else int(sizes[at])


# ---------------------------------------------------------------------------------------------
# the command line: flags as options


_CLI_VALUES = {"collective_matmul": {"auto": "auto", "on": True, "off": False}}


def check_cli(args: Any) -> None:
    """The command line's flags of ``args.command`` (argparse's namespace) checked as the options
    they set, by ``check``: e.g. ``nvtp explain --mesh 2x2 --microbatches 4`` is refused as
    ``microbatches=4`` without a pipeline axis is; a flag the command does not use, as well."""
    command = getattr(args, "command", None)
    if command not in COMMANDS:
        return
    options = {}
    for name in RULES:  # every flag that sets an option, so one the command does not use is refused, not ignored
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        value = _CLI_VALUES.get(name, {}).get(value, value) if isinstance(value, str) else value
        if name == "timeout" and value == 60.0:
            continue  # the flag's default, the same as the option's
        if name == "backend" and command == "replay" and value == "reference":
            continue  # replay's default backend
        if value is not None:
            options[name] = value
    if command == "replay" and "timeout" in options and not (options.get("plan") or (options.get("devices") or 1) > 1
                                                             or options.get("mesh")):
        raise OptionError(f"--timeout {options['timeout']:g} bounds the wait for a silent rank of a mesh of processes, and this "
                          "replay runs in one process: add --devices N (or --mesh, --plan) to replay on a mesh, or leave "
                          "--timeout out")
    check(command, **options)


# ---------------------------------------------------------------------------------------------
# wording


_PYTHON = {"jit": "nvtp.jit", "plan": "nvtp.plan", "transform": "nvtp.ShardingTransform"}


def _caller(entry: str) -> str:
    return _PYTHON.get(entry, f"nvtp {entry}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _spelled(entry: str, name: str, value: Any) -> str:
    if entry not in COMMANDS:
        return f"{name}={value!r}"
    typed = next((k for k, v in _CLI_VALUES.get(name, {}).items() if v is value), None)
    if typed is not None:
        return f"{_flag(name)} {typed}"
    if isinstance(value, bool):
        return _flag(name)
    return f"{_flag(name)} {value}"


def _summary(axis: str) -> str:
    return axes.AXES[axis].summary if axis in axes.AXES else axis


def _example(entry: str, axis: str) -> str:
    """How to make a mesh with ``axis``: its spelling by shape when it has one, else by name."""
    for ndim in (1, 2, 3):
        names = axes.spelled(ndim)
        if axis in names:
            shape = "x".join(n.upper() for n in names)
            if entry in COMMANDS:
                return f", --mesh {shape}" if ndim > 1 else f", --devices {shape}"
            return f", init_device_mesh(device, ({', '.join(names)}), mesh_dim_names={names!r})"
    return f", --mesh {axis}=N" if entry in COMMANDS else f", init_device_mesh(device, (n,), mesh_dim_names=({axis!r},))"


def _axes_text(names: tuple[str, ...]) -> str:
    return f"axes {', '.join(names)}" if len(names) > 1 else f"the axis {names[0]}" if names else "no named axes"


__all__ = ["OptionError", "RULES", "COMMANDS", "axis_options", "axis_refuses", "check", "check_cut", "check_cli", "given",
           "mesh_axes", "pipeline_options"]
