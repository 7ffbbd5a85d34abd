"""The op registry: what autopar knows about each torch / aten op, in one place.

One :class:`OpInfo` record per op (its kind, linearity, what selective
recompute keeps, its shape argument) and one :class:`KindInfo` per kind (its
cost family and, registered from :mod:`autopar.strategies.rules`, its
sharding rule). The tracer, the cost model, the sharding rules and the
compiler read these records instead of keeping tables of op names of their
own. The table itself is :mod:`autopar.ops.table`.
"""
from . import table as _table  # noqa: F401 - fills the registry
from .registry import (KindInfo, OpInfo, aten_packet, family, is_nonlinear, kind_info, kind_of, kinds,
                       matmul_kinds, nonlinear_ops, op_info, ops, register_kind, register_op, register_rule,
                       rule, rules, save_ops, shape_arg_ops, target_name)

__all__ = ["KindInfo", "OpInfo", "aten_packet", "family", "is_nonlinear", "kind_info", "kind_of", "kinds",
           "matmul_kinds", "nonlinear_ops", "op_info", "ops", "register_kind", "register_op", "register_rule",
           "rule", "rules", "save_ops", "shape_arg_ops", "target_name"]
