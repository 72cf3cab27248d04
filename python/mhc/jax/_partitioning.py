"""Partitioning rules for the custom calls, so that they stay sharded under plain ``jax.jit``.

An ``ffi_call`` is opaque to XLA's SPMD partitioner: with sharded operands it gathers them and runs
the call replicated. Each operation of ``_kernels`` is therefore an ``Operation``: a per-device
function (which calls the FFI targets, and collectives where the math needs them) plus the layout
of its operands and results, one letter per dimension:

- ``B``: the token (leading) dimensions, any number of them: they keep whatever sharding x has;
- ``d``: the features D: sharded over mesh axes that divide D (tensor parallelism), else gathered
  (always gathered for an operation with ``splits_features=False``, which writes D as ``e``);
- ``q``, ``r``: the parameters' rows, stream and feature (norm_weight [n, D], phi [n, D, N]): ``r``
  split like x's D (each device holds the rows of its features), else gathered; ``q`` replicated.
  Factors of their own, not x's ``n`` and ``d``: Shardy must not carry a sharding that only the
  parameters have (FSDP: their rows over a mesh axis x does not use) onto x and every activation,
  which then would be gathered back (twice per sublayer in the backward); the parameters (n*D x
  (N+1) values) are gathered instead;
- any other letter (``n``, ``m``: the streams; ``k``: N; ``p``: N+1; ``a``: the three alphas; the
  head's ``q``, ``f``, ``s``): replicated, so a mesh axis on the streams axis is gathered.

``jax.experimental.custom_partitioning`` takes both forms of the rule: ``sharding_rule`` (an
einsum-like string) for Shardy's propagation, ``infer_sharding_from_operands`` and
``propagate_user_sharding`` for GSPMD's; under both, ``partition`` picks the final shardings and
returns the per-device function. One ``Plan`` (the token axes, the feature axes) is derived from
the operand that carries x and applied to every operand and result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from mhc._config import Config


def _names(entry) -> tuple:
    """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call is split: ``tokens`` the spec entries of the B dimensions, ``features`` the
    entry of D; ``sizes`` the global sizes of the B dimensions and ``splits`` the number of shards
    of each (to find the rows XLA pads when a size does not divide).

    ``shares``: inside ``jax.shard_map`` (True), a value the same on every device of the feature
    axes that reaches the kernels as each device's copy (V4.1's carried mix) gets as cotangent
    this device's share, the sum over its own features; JAX's transpose of the replicated input
    sums the shares once (shard_map's psum without check_vma; with it, the psum that transposes
    the cast to varying), and a cotangent coming in for such a value (dh_pre) is a share, summed
    here before use. Under jit (False) the arrays are global: such cotangents are whole."""

    tokens: tuple
    features: object = None
    slices: int = 1
    sizes: tuple = ()
    splits: tuple = ()
    shares: bool = False

    @property
    def token_axes(self) -> tuple:
        return tuple(name for entry in self.tokens for name in _names(entry))

    @property
    def feature_axes(self) -> tuple:
        return _names(self.features)

    def spec(self, kinds: str) -> PartitionSpec:
        entries = []
        for kind in kinds:
            if kind == "B":
                entries.extend(self.tokens)
            else:
                entries.append(self.features if kind in "dr" else None)
        return PartitionSpec(*entries)

    def valid_tokens(self, local_lead: tuple):
        """None, or a bool mask [*local_lead]: False on the rows XLA added to pad uneven shards."""
        mask = None
        if not self.splits:  # the whole arrays
            return None
        for dim, (entry, size, splits) in enumerate(zip(self.tokens, self.sizes, self.splits, strict=True)):
            local = local_lead[dim]
            if splits == 1 or local * splits == size:
                continue
            index = jax.lax.axis_index(_names(entry)) * local + jnp.arange(local)
            shape = [1] * len(local_lead)
            shape[dim] = local
            valid = (index < size).reshape(shape)
            mask = valid if mask is None else mask & valid
        return None if mask is None else jnp.broadcast_to(mask, local_lead)


def whole(lead: int) -> Plan:
    """One device's plan: nothing split (the function run without a mesh, or on one device)."""
    return Plan(tokens=(None,) * lead)


@dataclasses.dataclass(frozen=True)
class Operation:
    """One partitioned operation. ``local(config, plan, *operands)`` runs on each device's shards
    and returns the tuple of results; ``targets`` are the kernels (FFI target names) it calls with
    D whole on each device, ``split_targets`` those it calls with D split (tensor parallelism)."""

    name: str
    targets: tuple
    split_targets: tuple
    operands: tuple
    results: tuple
    local: Callable = dataclasses.field(compare=False)
    primary: int = 0  # the operand whose sharding decides the plan (one shaped like x)
    # False for an operation without a split form (the head): D is gathered, never sharded.
    splits_features: bool = True
    # The documented fallback: the operations this one runs as where a platform lacks its own
    # kernels but has theirs (the boundary: post then pre); its local function picks that branch.
    fallback: tuple = dataclasses.field(default=(), compare=False)

    def rule(self, lead: int) -> tuple:
        """The Shardy rule: B -> b0 b1 ..., every other letter one factor; only B, d and r shard."""
        tokens = " ".join(f"b{i}" for i in range(lead))

        def mapping(kinds):
            return " ".join(tokens if kind == "B" else kind for kind in kinds).strip()

        rule = ", ".join(map(mapping, self.operands)) + " -> " + ", ".join(map(mapping, self.results))
        # In the order the factors first appear: Shardy wants the special factors sorted.
        letters = dict.fromkeys(kind for kinds in self.operands + self.results for kind in kinds if kind not in "Bdr")
        return rule, dict(need_replication_factors=tuple(letters))


@dataclasses.dataclass(frozen=True)
class _Static:
    operation: Operation
    config: Config
    lead: int  # number of B dimensions in this call


def _plan(static: _Static, mesh, shape) -> Plan:
    """The plan from the sharding of ``shape``, an x-shaped operand or result (the B dims first, D
    last); without a NamedSharding (no mesh to name the axes), nothing split."""
    lead = static.lead
    sharding = getattr(shape, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return whole(lead)
    entries = tuple(sharding.spec) + (None,) * (len(shape.shape) - len(sharding.spec))
    tokens, features = entries[:lead], entries[-1]
    sizes = tuple(shape.shape[:lead])
    splits = tuple(math.prod(mesh.shape[name] for name in _names(entry)) for entry in tokens)
    slices = math.prod(mesh.shape[name] for name in _names(features))
    if shape.shape[-1] % slices or not static.operation.splits_features:  # gather D
        features, slices = None, 1
    if slices == 1:
        features = None
    return Plan(tokens=tokens, features=features, slices=slices, sizes=sizes, splits=splits)


def _shardings(mesh, plan: Plan, layouts) -> tuple:
    return tuple(NamedSharding(mesh, plan.spec(kinds)) for kinds in layouts)


def _partition(static: _Static, mesh, arg_shapes, result_shape):
    operation = static.operation
    plan = _plan(static, mesh, arg_shapes[operation.primary])

    def lower(*operands):
        return operation.local(static.config, plan, *operands)

    return mesh, lower, _shardings(mesh, plan, operation.results), _shardings(mesh, plan, operation.operands)


def _infer(static: _Static, mesh, arg_shapes, result_shape):
    plan = _plan(static, mesh, arg_shapes[static.operation.primary])
    return _shardings(mesh, plan, static.operation.results)


def _propagate(static: _Static, mesh, user_shape):
    plan = _plan(static, mesh, user_shape[0])  # results[0] is x-shaped, with B and d
    return _shardings(mesh, plan, static.operation.results)


def _rule(static: _Static, mesh, operand_types, result_types):
    return static.operation.rule(static.lead)


@functools.partial(custom_partitioning, static_argnums=(0,))
def _run(static: _Static, *operands):
    return static.operation.local(static.config, whole(static.lead), *operands)


_run.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    propagate_user_sharding=_propagate,
    sharding_rule=_rule,
)


def _folds(operation: Operation, in_batched) -> bool:
    """Whether a vmap of ``operation`` can be one call with the batch axis as one more token axis:
    only token-shaped operands (letter ``B`` first) are batched, and every result is token-shaped.
    A parameter-shaped result (a parameter gradient, a sum over the tokens) must stay one sum per
    batch element under vmap, which one call over all the elements' tokens cannot give."""
    token_operand = [kinds.startswith("B") for kinds in operation.operands]
    batches_parameters = any(b and not token for b, token in zip(in_batched, token_operand, strict=True))
    return not batches_parameters and all(kinds.startswith("B") for kinds in operation.results)


def apply(operation: Operation, config: Config, lead: int, *operands) -> tuple:
    """Runs ``operation`` on whole arrays; partitioned by its rule under jit on a mesh.

    custom_partitioning has no batching rule, so vmap is defined here (custom_vmap). Where only
    the token axes are batched and every result is per token (``_folds``: the forward operations,
    post's backward), the batch axis becomes one more token axis: one call on all the tokens, the
    kernels taking any number of them (custom_vmap hands the batch axis over first, next to the
    token axes, so no data moves; an unbatched token operand is broadcast). Otherwise (a batched
    parameter, or parameter gradients, one sum per batch element) the calls run one batch
    element at a time (``lax.map``).
    """
    static = _Static(operation, config, lead)

    @jax.custom_batching.custom_vmap
    def run(*operands):
        return tuple(_run(static, *operands))

    @run.def_vmap
    def _batched(axis_size, in_batched, *operands):
        if _folds(operation, in_batched):
            folded = [
                a if b or not kinds.startswith("B") else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, b, kinds in zip(operands, in_batched, operation.operands, strict=True)
            ]
            results = apply(operation, config, lead + 1, *folded)
            return results, tuple(True for _ in results)

        batched = [a for a, b in zip(operands, in_batched, strict=True) if b]

        def one(sliced):
            it = iter(sliced)
            return run(*(next(it) if b else a for a, b in zip(operands, in_batched, strict=True)))

        results = jax.lax.map(one, batched)
        return results, tuple(True for _ in results)

    return run(*operands)
