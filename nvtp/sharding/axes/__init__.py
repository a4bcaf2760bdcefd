"""Mesh axes: each name selects a strategy, one module each, registered here.

    roles(mesh)                       # {"dp": 0, "tp": 1}: each axis name -> its index, the mesh checked
    for s, axis in passes(mesh): ...  # the sharding passes of a mesh, in the order the driver runs them
    AXES["tp"].summary                # what sharding along an axis means

* ``tp``  tensor parallel: the plan (megatron, megatron-sp, explicit) splits weights and activations
* ``dp``  data parallel: each rank passes its own batch; ``fsdp=True`` also splits the weights (ZeRO-3)
* ``cp``  context parallel: the sequence split, attention by ring (``ring``: its steps as data)
* ``pp``  pipeline parallel: the model cut into stages (``nvtp.pipeline``), each sharded over the rest

``strategy.py`` says what a strategy owns and holds the registry; nothing outside this package
branches on an axis's name. A new axis is one module that registers its ``Strategy`` and a line
here importing it.
"""

from nvtp.sharding.axes.strategy import (AXES, AxisPass, MeshError, Strategy, axis_sizes, batch_axis, check, data_mode, extent, find, known, plain,
                                         passes, register, roles, spelled, stage_axis, strategies, trace_options, whole_at_rest)
from nvtp.sharding.axes import tp, dp, cp, pp  # noqa: E402,F401 - registration, in this order
from nvtp.sharding.axes.pp import Layout, has_pp as pipelined, layout_of  # noqa: E402

__all__ = ["AXES", "Layout", "layout_of", "pipelined", "AxisPass", "MeshError", "Strategy", "axis_sizes", "batch_axis", "check", "data_mode", "extent", "find", "known", "plain", "passes", "register",
           "roles", "spelled", "stage_axis", "strategies", "trace_options", "whole_at_rest"]
