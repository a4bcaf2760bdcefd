"""nvtp's fusion IR: nvFuser's FusionDefinition as plain data."""

from nvtp.ir.build import FusionBuilder, make_op
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, Value, ValueInfo
from nvtp.ir.ops import OPS, IRError
from nvtp.ir.printer import format_definition, format_file, format_op
from nvtp.ir.verify import verify

__all__ = [
    "DType", "Fusion", "FusionBuilder", "IRError", "OPS", "Op", "ScalarValue", "TensorValue", "Value",
    "ValueInfo", "format_definition", "format_file", "format_op", "make_op", "verify",
]
