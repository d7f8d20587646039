"""The protocol every compression method follows: one object that owns everything about a method.

A method is a frozen (hashable, comparable) dataclass. It validates its own settings at
construction, naming the argument in the error, and answers every question the rest of jaxcomp
asks about it:

========================  ==========================================================================
inside ``shard_map``      :meth:`Method.aggregate`: ``(total, sent, state)`` of one device's 1-D
                          vector (``state``: the method's own, e.g. PowerSGD's warm-started ``Q``;
                          None for a method without state); :meth:`Method.kept`: how many values it
                          sends of ``n``
the cost model            :meth:`Method.wire_bytes` (bytes one device sends) and
                          :meth:`Method.message_steps` (sequential messages, the α term)
timing its local work     :meth:`Method.local_work` (a function of one device's vector, with the
                          collectives taken out) and :attr:`Method.codec_skipped_on_one_device`
tables and metrics        :attr:`Method.label`, :attr:`Method.setting`, :meth:`Method.describe`
state across steps        :meth:`Method.init_state` (:attr:`Method.stateful` says whether a method
                          has one), with the leaves' shapes
sharded training          :meth:`Method.reduce_scatter` (each device gets its shard of the sum),
                          :meth:`Method.shard_row`, :meth:`Method.reduce_scatter_bytes` and
                          :meth:`Method.reduce_scatter_steps`; :attr:`Method.scatters` says whether
                          the method has this form
========================  ==========================================================================

:func:`jaxcomp.compress`, :func:`jaxcomp.compress_auto`, :mod:`jaxcomp.costmodel.cost`,
:mod:`jaxcomp.costmodel.probe`, ``jaxcomp advise``, the demo and the benchmarks only ever call
these; none of them knows a method by name. To add a method, subclass :class:`Method` in a file
of its own (see ``docs/methods.md``); it then works everywhere, also when it is defined outside
jaxcomp.

This module loads no JAX: the cost model and the advisor's command line stay cheap to import.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class Method:
    """Base class of a compression method (subclass it as a
    ``@dataclasses.dataclass(frozen=True)``).

    **Required** of every method:

    * ``name`` (class attribute): the short name in tables and metrics (:attr:`label` adds
      variants to it).
    * :meth:`aggregate` ``(x, axis_name, *, step, key, sparse=False, state=None)``: inside
      ``shard_map``, returns ``(total, sent, state)``: the sum over the devices, this device's
      contribution as the sum saw it (error feedback keeps ``x - sent``), and the method's new
      state, which a method without state returns as it got it (None). Exchange through
      :mod:`jaxcomp.collectives`, so that every byte crossing devices is in one layer.
    * :meth:`wire_bytes` and :meth:`message_steps`: what one device sends, and in how many
      sequential messages, for the cost model.

    **Optional**, each with its default (override only what differs):

    * ``axes_needed = None``: mesh axes the method reduces over, in order (``None``: any number,
      reduced over all of them; ``2``: exactly ``(outer, inner)``, as hierarchical top-k needs).
    * ``sends_everything = False``: the method loses nothing (no residual to keep, gain 1, no
      codec) and sums elementwise: the total of two vectors end to end is their totals end to
      end (a step with a non-finite sum sums again as one vector).
    * ``buckets_by_default = False``: ``compress(bucket_mb="auto")`` (its default) cuts the
      leaves into DDP's 25 MiB buckets, sent while the backward pass runs, for this method; set
      where a bucket's result is the whole message's own values (up to the order of the sum's
      roundings): dense and the casts. A method that selects or codes (top-k's ``ratio`` of each
      bucket) keeps one message unless ``bucket_mb=`` asks.
    * ``feeds_back_by_default = True``: ``compress(error_feedback="auto")`` (its default) keeps
      a residual for this method. False where what a step loses is only each value's rounding,
      unbiased and small, and the residual costs a gradient's memory and its passes for no
      measured quality: the casts, as PyTorch's fp16 and bf16 hooks run.
    * ``rounds_only = False``: the method sends every value, only rounded to a narrower float
      (each rounding at most ``2**-8`` of the value): the metrics then count its compression
      gain as 1 and read the error-fed vector's energies, which the packing summed, instead of
      ``sent``'s, so that a step without error feedback never builds ``sent`` (the casts).
    * ``sparse = False``: :meth:`aggregate` can return ``sent`` as ``(indices, values)`` pairs
      when asked (``sparse=True``), so error feedback takes them off in place instead of
      subtracting a dense vector. Asked so, it may also return ``total`` as a
      :class:`jaxcomp.ops.scatter.SparseTotal` (the summed pairs), which the update writes
      straight into the leaves (top-k and random-k do).
    * ``pieces = False``: :meth:`aggregate` takes ``pieces=True`` (passed only to such a method),
      and then may return ``total`` and ``sent`` as :class:`jaxcomp.ops.pieces.Pieces`, never
      joined into one vector, cut as its ``piece_sizes(shapes)`` says (each part whole leaves of
      ``shapes=``): each part becomes its leaves' updates and residuals without a pass that
      joins and one that splits (PowerSGD's ``P Q^T`` per matrix does).
    * ``decoded_sent = False``: :meth:`aggregate` takes ``decoded=True`` (passed only to such
      a method, and never under ``lax.switch``, whose branches must return alike) and may then
      return ``sent`` as :class:`jaxcomp.ops.sign.ScaledSigns`: the decoded vector beside the
      few values that give its energies, so that the metrics do not read it again (the sign
      codec's scales: :class:`Sign` does).
    * ``replicated_total = True``: ``total`` comes out typed replicated (invariant) inside
      ``shard_map``; :func:`jaxcomp.compress_auto` needs this of every candidate, since its
      branches must agree.
    * ``codec_skipped_on_one_device = False``: the method's collective runs no codec when it
      reduces over one device (ZFP's ring, THC's quantizer return their input). Every method's
      overhead is measured on the real update on one device
      (:func:`jaxcomp.optim.timing.update_seconds`); such a method adds its :meth:`local_work`
      timed on its own, which that update did not run.
    * :attr:`wire_dtype` (None): the float dtype the devices' values are summed in on the wire,
      when it is narrower than the gradient's and nothing scales them into its range (an
      unscaled float16 cast): the overflow guard then checks the sums against its largest value.
    * ``shorthand = {}``: the method's string names for :func:`jaxcomp.compress` and the command
      lines, each with the options it fixes (``{"ar_topk": {"collective": "ar"}}``); a method
      module in :mod:`jaxcomp.methods` is found and its names join
      :data:`jaxcomp.methods.SHORTHAND` without being listed anywhere else.
    * :meth:`kept` (``n``), :attr:`setting` (None), :meth:`with_ratio` (None),
      :attr:`dense_steps` (0), :meth:`local_work` (None), :attr:`label` (``name``).
    * State across steps: :meth:`init_state` (the method then is :attr:`stateful`, and
      :meth:`aggregate`, :meth:`kept` and :meth:`wire_bytes` take ``shapes=``, the leaves its
      vector is made of).
    * Sharded training: :meth:`reduce_scatter` with :meth:`reduce_scatter_bytes` and
      :meth:`reduce_scatter_steps` (the method then :attr:`scatters`), and :meth:`shard_row`
      (``m``) when a row needs padding.

    Provided, not to be overridden: :meth:`describe` and :meth:`check_axes`.

    A method written for jaxcomp 0.1 (``aggregate`` without ``state=`` returning ``(total,
    sent)``, or ``aggregate_stateful``) keeps working until jaxcomp 0.3, with a
    ``DeprecationWarning`` that says how to update it.

    Example:
      >>> import dataclasses
      >>> from jaxcomp.methods import Method
      >>> @dataclasses.dataclass(frozen=True)
      ... class Sum(Method):  # the plain all-reduce, written from scratch
      ...     name = "sum"
      ...     sends_everything = True
      ...     def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
      ...         from jaxcomp import collectives
      ...         total, sent = collectives.psum(x, axis_name)
      ...         return total, sent, state
      ...     def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
      ...         return 2.0 * (n_devices - 1) / n_devices * n * dtype_bytes
      ...     def message_steps(self, n_devices, *, inner_size=None):
      ...         return 2 * (n_devices - 1)
      >>> Sum().wire_bytes(1000, 8), Sum().label, Sum().stateful, Sum().scatters
      (7000.0, 'sum', False, False)
    """

    name: ClassVar[str] = "method"
    axes_needed: ClassVar[int | None] = None
    sends_everything: ClassVar[bool] = False
    buckets_by_default: ClassVar[bool] = False
    feeds_back_by_default: ClassVar[bool] = True
    rounds_only: ClassVar[bool] = False
    sparse: ClassVar[bool] = False
    pieces: ClassVar[bool] = False
    decoded_sent: ClassVar[bool] = False
    replicated_total: ClassVar[bool] = True
    codec_skipped_on_one_device: ClassVar[bool] = False
    shorthand: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _adapt_0_1_protocol(cls)

    # ---- identity -------------------------------------------------------------------------------

    @property
    def wire_dtype(self) -> str | None:
        """The narrower float dtype the sums travel in, unscaled, or None (see the class doc)."""
        return None

    @property
    def label(self) -> str:
        """The method's name in tables and metrics, with its variant (e.g. ``"ar_topk_tree"``: a
        method costed with a tree all-reduce, ``allreduce="tree"``, says so)."""
        allreduce = getattr(self, "allreduce", "ring")
        return self.name if allreduce == "ring" else f"{self.name}_{allreduce}"

    @property
    def setting(self) -> float | int | None:
        """The one number that sizes the message (a ratio, rate or bits), or None."""
        return None

    def describe(self) -> str:
        """``label`` with ``setting``, e.g. ``"ar_topk(0.01)"``; what tables print."""
        return self.label if self.setting is None else f"{self.label}({self.setting:.3g})"

    @property
    def dense_steps(self) -> int:
        """Steps this method wants aggregated densely before it starts (PowerSGD's ``start_iter``);
        :func:`jaxcomp.compress` warms up for ``max(warmup_steps, dense_steps)`` steps."""
        return 0

    def with_ratio(self, ratio: float) -> Method | None:
        """This method sending a fraction ``ratio`` of the values, or None when it has no such knob
        (:func:`jaxcomp.compress_auto`'s ratio search uses it)."""
        return None

    def steps_along(self, x):
        """``x`` (any shape, on one device) as this method shapes what it sends, without its
        coding error and without any exchange. On its guardrail's dense steps
        :func:`jaxcomp.adam` steps no coordinate further than this shape of the exact momentum
        (nor further than the momentum itself), so that falling back does not leave the rule
        the run was stable under. The identity by default (what a method that sends every
        value decodes to, close enough); :class:`~jaxcomp.methods.Sign` gives scaled signs.

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxcomp.methods import Dense
          >>> Dense().steps_along(jnp.array([1.0, -3.0])).tolist()
          [1.0, -3.0]
        """
        return x

    # ---- inside shard_map -----------------------------------------------------------------------

    def check_axes(self, axes: tuple[str, ...]) -> None:
        """Raises a ValueError naming ``axis_name`` when the method cannot reduce over ``axes``."""
        if self.axes_needed is not None and len(axes) != self.axes_needed:
            how = (
                "axis_name=(outer, inner), e.g. ('node', 'device'): the slow axis between nodes "
                "first, the fast one inside a node"
                if self.axes_needed == 2
                else f"{self.axes_needed} axes in order"
            )
            raise ValueError(
                f"method {self.describe()} needs {how}; got axis_name="
                f"{axes if len(axes) > 1 else axes[0]!r}"
            )

    def kept(self, n: int) -> int:
        """Values of an ``n``-vector this method selects (a top-k's ``k``; ``n`` by default)."""
        return n

    def kept_on(self, n: int, n_devices: int, **shaped) -> int:
        """Values of each device's ``n``-vector whose content is sent on ``n_devices`` devices:
        the ``density`` metric's numerator. :meth:`kept` unless the exchange sends more of each
        vector than the method selects (AR-Topk's SPLIT: ``N ceil(k/N)`` slots).

        Args:
          n: the vector's length.
          n_devices: devices in the reduction.
          **shaped: the method's shape arguments (PowerSGD's ``shapes``), as for :meth:`kept`.

        Returns:
          An int in ``[0, n]``.

        Example:
          >>> from jaxcomp.methods import TopK
          >>> TopK(0.01).kept_on(1000, 8), TopK(0.01, collective="ar").kept_on(1000, 8)
          (10, 16)
        """
        return self.kept(n, **shaped)

    def aggregate(
        self, x, axis_name, *, step, key, sparse: bool = False, state: Any = None
    ) -> tuple[Any, Any, Any]:
        """Aggregates this device's 1-D vector ``x`` inside ``shard_map``: ``(total, sent, state)``.

        Args:
          x: this device's local 1-D vector (float32, or the gradients' 16-bit float).
          axis_name: the mesh axis, or the tuple of axes, to sum over.
          step: the training step (an int32 scalar, replicated).
          key: a ``jax.random`` key for this step and vector, replicated.
          sparse: with :attr:`sparse`, return ``sent`` as ``(indices, values)`` (and ``total``
            as a dense vector or a :class:`jaxcomp.ops.scatter.SparseTotal`).
          state: with :attr:`stateful`, the method's state from :meth:`init_state` for these
            leaves (or from the previous step); None otherwise. A stateful method also takes
            ``shapes=``, the shapes of the leaves ``x`` is made of.

        Returns:
          ``total``, the sum over the devices, identical on every device (typed replicated when
          :attr:`replicated_total`); ``sent``, this device's contribution as the sum saw it, so
          that ``x - sent`` is what error feedback keeps; and ``state``, the method's new state
          (the same structure, replicated), or the ``state`` given (None) for a method without
          state.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement aggregate")

    # ---- state across steps ---------------------------------------------------------------------

    @property
    def stateful(self) -> bool:
        """Whether the method keeps state of its own across steps: it implements
        :meth:`init_state`, and its :meth:`aggregate`, :meth:`kept` and :meth:`wire_bytes` take
        ``shapes=``."""
        return type(self).init_state is not Method.init_state

    def init_state(self, shapes: tuple[tuple[int, ...], ...]) -> Any:
        """The state for one vector made of leaves of ``shapes`` (flattened and concatenated in
        that order), replicated on every device; a pytree of arrays, saved in checkpoints with the
        rest of the optimizer state. Raises a ValueError naming the setting that cannot serve
        these shapes. Only a method with state implements it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state of its own")

    # ---- sharded training (reduce-scatter) -------------------------------------------------------

    @property
    def scatters(self) -> bool:
        """Whether the method has a reduce-scatter form (:meth:`reduce_scatter`), which
        ``jaxcomp.data_parallel(..., shard=...)`` needs: by default, whether it implements one."""
        return type(self).reduce_scatter is not Method.reduce_scatter

    def shard_row(self, m: int, n_devices: int) -> int:
        """Values per device row that :meth:`reduce_scatter` needs for shards of ``m`` values (at
        least ``m``; e.g. whole Hadamard blocks). Applying it to its own result gives it back."""
        return m

    def reduce_scatter(
        self, x, axis_name, *, step, key, size, sparse: bool = False
    ) -> tuple[Any, Any]:
        """With :attr:`scatters`: this device's shard of the sum, ``(shard, sent)`` (no method
        with state has this form, so there is no state to return).

        Args:
          x: this device's 1-D vector of ``N * row`` values, laid out shard-major
            (:func:`jaxcomp.optim.sharding.shard_major`), with ``row`` from :meth:`shard_row`.
          axis_name: the mesh axis, or the tuple of axes, to sum over (device ``d``'s position
            along them is its row).
          step: the training step (an int32 scalar, replicated).
          key: a ``jax.random`` key for this step and vector, replicated.
          size: how many of ``x``'s values are real (the rest is padding), for the share a
            method keeps (``kept(size)``).
          sparse: with :attr:`sparse`, return ``sent`` as ``(indices, values)``.

        Returns:
          ``shard``: row ``d`` (``row`` values) of the sum over the devices, on device ``d``;
          ``sent``: this device's contribution as the sum saw it (all ``N * row`` values), so
          that ``x - sent`` is what error feedback keeps.
        """
        raise ValueError(
            f"method {self.describe()} has no reduce-scatter form, so it cannot aggregate sharded "
            f"gradients (data_parallel(shard=...)); methods that can: {', '.join(scattering())}"
        )

    def reduce_scatter_bytes(self, n: int, n_devices: int, *, dtype_bytes: int = 4) -> float:
        """Bytes one device sends in :meth:`reduce_scatter` of ``n`` values over ``n_devices``."""
        raise ValueError(f"method {self.describe()} has no reduce-scatter form")

    def reduce_scatter_steps(self, n_devices: int) -> int:
        """Sequential message steps of :meth:`reduce_scatter` (the α term)."""
        raise ValueError(f"method {self.describe()} has no reduce-scatter form")

    # ---- the cost model -------------------------------------------------------------------------

    def wire_bytes(
        self, n: int, n_devices: int, *, dtype_bytes: int = 4, inner_size: int | None = None
    ) -> float:
        """Bytes one device sends to aggregate ``n`` values over ``n_devices`` (its busiest path).

        ``inner_size`` is the number of devices of the last (fastest) axis when the method reduces
        over two axes; methods that ignore the topology ignore it."""
        raise NotImplementedError(f"{type(self).__name__} must implement wire_bytes")

    def message_steps(self, n_devices: int, *, inner_size: int | None = None) -> int:
        """Sequential message steps over ``n_devices``: what the α-β model multiplies α by."""
        raise NotImplementedError(f"{type(self).__name__} must implement message_steps")

    # ---- timing ---------------------------------------------------------------------------------

    def local_work(self, n_values: int, n_devices: int) -> Callable | None:
        """A function of one device's 1-D float32 vector that does this method's local work (its
        codec) with the collectives taken out, for timing; None when it has none."""
        return None


_HOW_TO_UPDATE = (
    "def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None{shapes}) returning "
    "(total, sent, state){what} (docs/methods.md, 'How to write a method')"
)


def _adapt_0_1_protocol(cls) -> None:
    """Keeps a method written for jaxcomp 0.1 working until 0.3, with a DeprecationWarning: its
    ``aggregate`` without ``state=`` (returning ``(total, sent)``) or its ``aggregate_stateful``
    (``(total, sent, state)``) becomes the one :meth:`Method.aggregate`."""
    own = cls.__dict__.get("aggregate")
    old_stateful = cls.__dict__.get("aggregate_stateful")
    if old_stateful is not None and own is None:

        def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None, shapes=None):
            return old_stateful(self, x, axis_name, step=step, key=key, state=state, shapes=shapes)

        how = _HOW_TO_UPDATE.format(shapes=", shapes=None", what=", one method for both")
        _warn(f"{cls.__qualname__}.aggregate_stateful is jaxcomp 0.1's protocol; write {how}")
    elif own is not None and not _takes_state(own):

        def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
            total, sent = own(self, x, axis_name, step=step, key=key, sparse=sparse)
            return total, sent, state

        how = _HOW_TO_UPDATE.format(
            shapes="", what=": a method without state returns state as given"
        )
        _warn(
            f"{cls.__qualname__}.aggregate takes no state= and returns (total, sent), jaxcomp "
            f"0.1's protocol; write {how}"
        )
    else:
        return
    aggregate.__qualname__ = f"{cls.__qualname__}.aggregate"
    aggregate.__doc__ = Method.aggregate.__doc__
    cls.aggregate = aggregate


def _takes_state(function) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == "state" or p.kind is p.VAR_KEYWORD for p in parameters)


def _warn(message: str) -> None:
    # Levels: _warn, _adapt_0_1_protocol, Method.__init_subclass__, then the class statement.
    warnings.warn(
        f"{message}; the old form keeps working until jaxcomp 0.3",
        DeprecationWarning,
        stacklevel=4,
    )


def scattering() -> list[str]:
    """jaxcomp's methods (and variants) with a reduce-scatter form, for messages.

    Returns:
      Their names, as a user would write them.

    Example:
      >>> scattering()[0]
      'Dense'

    References:
      Rajbhandari et al., ZeRO, SC 2020 (gradients reduce-scattered to their owners).
    """
    return [
        "Dense",
        "Cast (bf16, fp16)",
        "Zfp (algorithm='ring')",
        "Quantized",
        "TopK (collective='allgather' or 'ar')",
        "Sign (aggregation='ring')",
    ]


class Fraction:
    """Mixin of the methods that send a fraction of the values: ``ratio`` or ``k`` (fields of the
    subclass), validated by :meth:`check_fraction`, with ``setting``, ``with_ratio`` and
    ``kept``."""

    def check_fraction(self) -> None:
        """Validates ``ratio``/``k`` (exactly one; ``ratio`` in ``(0, 1]``, ``k >= 1``), in
        place."""
        from jaxcomp.ops import _checks

        if (self.ratio is None) == (self.k is None):
            raise ValueError(
                f"{type(self).__name__} needs exactly one of ratio= (fraction of entries sent, "
                f"e.g. 0.01) or k= (entries sent), got ratio={self.ratio!r}, k={self.k!r}"
            )
        if self.ratio is not None:
            object.__setattr__(self, "ratio", _checks.check_ratio(self.ratio))
        else:
            object.__setattr__(
                self, "k", _checks.static_int(self.k, "k", 1, _checks.MAX_ROW_LENGTH)
            )

    @property
    def setting(self):
        return self.ratio if self.ratio is not None else self.k

    def with_ratio(self, ratio):
        return dataclasses.replace(self, ratio=ratio, k=None)

    def kept(self, n):
        from jaxcomp.collectives import sizes

        if self.ratio is not None:
            return sizes.resolve_k(n, None, self.ratio)
        if self.k > n:
            raise ValueError(
                f"k={self.k} exceeds the {n} gradient entries it is taken from; pass a smaller k "
                "or ratio="
            )
        return self.k
