"""``TopK``: top-k sparsification, aggregated by all-gather, AR-Topk or hierarchically, its values
in full precision or as low-bit codes (``value_bits``)."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import LEADERS, SELECTORS, sizes
from jaxcomp.methods.base import Fraction, Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks

#: How the selected values travel (:mod:`jaxcomp.collectives`): ``allgather_topk``, ``ar_topk``
#: or ``hierarchical_topk``.
COLLECTIVES = ("allgather", "ar", "hierarchical")


@dataclasses.dataclass(frozen=True)
class TopK(Fraction, Method):
    """Top-k sparsification: each device sends its ``k`` largest-magnitude values (and indices).

    Args:
      ratio: fraction of the values sent, in ``(0, 1]``: ``k = max(1, round(ratio * n))``.
      k: number of values sent (per group: the model, or each leaf with
        ``compress(..., granularity="leaf")``); give exactly one of ``ratio`` and ``k``.
      collective: how they are aggregated: ``"allgather"`` (default; every device gathers every
        device's pairs, :func:`jaxcomp.collectives.allgather_topk`), ``"ar"`` (AR-Topk: one
        leader's indices, then one all-reduce of the values, :func:`jaxcomp.collectives.ar_topk`)
        or ``"hierarchical"`` (HiTopKComm on ``axis_name=(outer, inner)``,
        :func:`jaxcomp.collectives.hierarchical_topk`).
      selector: ``"exact"`` (default, :func:`jaxcomp.topk`) or ``"threshold"`` (MSTopK,
        :func:`jaxcomp.threshold_topk`).
      leader: ``collective="ar"`` only: ``"split"`` (default: every device picks ``k / N`` of
        the indices, its own largest), ``"star"`` (the paper's rule: one device's ``k``,
        round-robin by step) or ``"var"`` (the device with the largest local top-k norm); see
        :func:`jaxcomp.collectives.ar_topk`.
      allreduce: ``collective="ar"`` only: how the cost model costs its two all-reduces,
        ``"ring"`` (default) or ``"tree"``.
      value_bits: ``collective="allgather"`` only: None (default: the values in the gradient's
        dtype) or the bits each selected value travels in, 1 to 4 (SparseLoCo sends 2): codes
        on a symmetric grid spanning the largest magnitude of each ``value_chunk`` selected
        values, rounded to the nearest level, packed into uint32 words and all-gathered with
        the indices and one float32 scale per chunk
        (:mod:`jaxcomp.collectives.value_codes`). Every device adds the decoded values, and
        those are what error feedback takes off the residual, so each value's rounding is sent
        on a later step.
      value_chunk: with ``value_bits``: selected values per scale, consecutive in index order
        (default 64: half a bit a value, and an outlier coarsens only its own chunk's grid).

    **Low-bit values** (``TopK(0.02, value_bits=2)``). At 2 bits a pair is 32 bits of index, 2 of
    code and half a bit of scale: about half a float32 pair's bytes (``wire_bytes`` counts each
    part). Rounding is deterministic, as in SparseLoCo: error feedback carries each value's
    rounding, so stochastic rounding's unbiasedness buys nothing and the sent values need no
    key. Only the all-gather takes codes: AR-Topk sums the values in one all-reduce, where codes
    on each device's own scales do not add (:class:`Quantized` sums codes on one shared grid),
    and hierarchical top-k sums a node's values before it selects. SparseLoCo applies this to
    DiLoCo's pseudo-gradients: ``jaxcomp.diloco(..., compress=TopK(0.02, value_bits=2))``.

    With Adam after it and a short run, top-k costs more quality than its bytes suggest, with or
    without error feedback. DGC's momentum correction with Adam's own momentum off and a dense
    warm-up brought the all-gather at 1% within a few percent of dense's held-out loss::

        optax.chain(jaxcomp.compress(TopK(0.01), warmup_steps=100, momentum_correction=0.9),
                    optax.adam(learning_rate, b1=0.0))

    A shorter warm-up sent as ZFP (``warmup_steps=50, warmup_method=jaxcomp.Zfp(8)``) keeps about
    that quality at several times fewer bytes over a whole run than the dense warm-up.
    :func:`jaxcomp.adam` halves the gap at its defaults. **AR-Topk and 0.1% are not within 3% of
    dense Adam with anything tried** (docs/training.md, "What the methods cost in model
    quality"; BENCHMARKS.md, "What each method costs in quality").

    AR-Topk's default leader is SPLIT (every device picks ``k / N`` of the indices on every
    step), not the paper's STAR: with the recipe it ends nearer dense's loss than STAR and, on a
    slow link, reaches dense's loss sooner, at a step about as fast (docs/training.md, "What the
    methods cost in model quality"). ``leader="star"`` (``"ar_topk_star"``) keeps the paper's
    rule.

    Example:
      >>> from jaxcomp.methods import TopK
      >>> TopK(0.01, collective="ar").describe(), TopK(0.01).wire_bytes(1000, 8)
      ('ar_topk(0.01)', 560.0)
      >>> TopK(0.01, collective="ar", leader="star").label
      'ar_topk_star'

    References:
      Tyagi & Swany, arXiv 2312.02493 (AR-Topk, STAR/VAR, Table I, Eqn 4a/4b); Shi et al.,
      MLSys 2021, §3.1-3.2 (MSTopK, HiTopKComm); Sarfi et al., "Communication Efficient LLM
      Pre-training with SparseLoCo", arXiv 2508.15706 (top-k with 2-bit values and error
      feedback).
    """

    ratio: float | None = None
    k: int | None = None
    collective: str = "allgather"
    selector: str = "exact"
    leader: str = "split"
    allreduce: str = "ring"
    value_bits: int | None = None
    value_chunk: int = sizes.DEFAULT_VALUE_CHUNK

    sparse = True
    shorthand = {
        "allgather_topk": {"collective": "allgather"},
        "ar_topk": {"collective": "ar"},
        "ar_topk_ring": {"collective": "ar"},
        "ar_topk_tree": {"collective": "ar", "allreduce": "tree"},
        # SPLIT's former names (the default leader since 2026-11-29).
        "ar_topk_split": {"collective": "ar", "leader": "split"},
        "ar_topk_split_tree": {"collective": "ar", "leader": "split", "allreduce": "tree"},
        "ar_topk_star": {"collective": "ar", "leader": "star"},
        "ar_topk_star_tree": {"collective": "ar", "leader": "star", "allreduce": "tree"},
        "ar_topk_var": {"collective": "ar", "leader": "var"},
        "hierarchical_topk": {"collective": "hierarchical"},
    }

    def __post_init__(self):
        self.check_fraction()
        _checks.check_choice(self.collective, "collective", COLLECTIVES)
        _checks.check_choice(self.selector, "selector", SELECTORS)
        _checks.check_choice(self.leader, "leader", LEADERS)
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)
        for option, default in (("leader", "split"), ("allreduce", "ring")):
            if getattr(self, option) != default and self.collective != "ar":
                raise ValueError(
                    f"{option}= applies to collective='ar' only, not {self.collective!r}; remove it"
                )
        self._check_value_codes()

    def _check_value_codes(self):
        """Validates ``value_bits`` and ``value_chunk`` (in place), naming them."""
        chunk = _checks.static_int(self.value_chunk, "value_chunk", 1, _checks.MAX_ROW_LENGTH)
        object.__setattr__(self, "value_chunk", chunk)
        if self.value_bits is None:
            if chunk != sizes.DEFAULT_VALUE_CHUNK:
                raise ValueError("value_chunk= applies with value_bits= only; remove it")
            return
        bits = _checks.static_int(self.value_bits, "value_bits", 1, sizes.MAX_VALUE_BITS)
        object.__setattr__(self, "value_bits", bits)
        if self.collective != "allgather":
            raise ValueError(
                f"value_bits= applies to collective='allgather' only, not {self.collective!r}: "
                "AR-Topk sums the values in one all-reduce, where codes on each device's own "
                "scales do not add, and hierarchical top-k sums a node's values before it "
                "selects; use collective='allgather', or remove value_bits"
            )

    @property
    def axes_needed(self):
        return 2 if self.collective == "hierarchical" else None

    @property
    def name(self):
        return f"{self.collective}_topk"

    @property
    def label(self):
        """As :attr:`Method.label`, with a leader other than the default SPLIT named
        (``"ar_topk_star"``, ``"ar_topk_var"``) and low-bit values
        (``"allgather_topk_2bit"``): their bytes and quality differ."""
        name = self.name if self.leader == "split" else f"{self.name}_{self.leader}"
        name = name if self.value_bits is None else f"{name}_{self.value_bits}bit"
        return name if self.allreduce == "ring" else f"{name}_{self.allreduce}"

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        from jaxcomp import collectives

        k = self.kept(x.shape[0])
        if self.collective == "allgather":
            total, sent = collectives.allgather_topk(
                x,
                k,
                axis_name,
                selector=self.selector,
                sparse_sent=sparse,
                sparse_total=sparse,
                **self._value_codes,
            )
        elif self.collective == "ar":
            total, sent = collectives.ar_topk(
                x,
                k,
                axis_name,
                leader=self.leader,
                step=step,
                selector=self.selector,
                sparse_sent=sparse,
                sparse_total=sparse,
            )
        else:
            outer, inner = axis_name
            total, sent = collectives.hierarchical_topk(
                x, k, inner, outer, selector=self.selector, sparse_sent=sparse
            )
        return total, sent, state

    @property
    def _value_codes(self) -> dict:
        """The low-bit values' options of :func:`jaxcomp.collectives.allgather_topk`, or none."""
        if self.value_bits is None:
            return {}
        return {"value_bits": self.value_bits, "value_chunk": self.value_chunk}

    def kept_on(self, n, n_devices, **shaped):
        """As :meth:`Method.kept_on`: SPLIT sends each device's values at the ``N ceil(k/N)``
        gathered indices (repeats sent as padding), every other exchange ``k`` of them."""
        k = self.kept(n)
        if self.collective != "ar" or self.leader != "split":
            return k
        N = _checks.check_devices(n_devices)
        return min(N * sizes.ceil_div(k, N), n)

    @property
    def scatters(self):
        return self.collective != "hierarchical"

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        """The same selection and exchange as :meth:`aggregate`, with ``k`` taken of the ``size``
        real values; each device adds only the pairs that fall in its own row (the sharded
        run's update is bit for bit the replicated one's)."""
        from jaxcomp import collectives

        if not self.scatters:
            return super().reduce_scatter(x, axis_name, step=step, key=key, size=size)
        k = self.kept(size)
        if self.collective == "allgather":
            return collectives.allgather_topk(
                x,
                k,
                axis_name,
                selector=self.selector,
                sparse_sent=sparse,
                scatter=True,
                **self._value_codes,
            )
        return collectives.ar_topk(
            x,
            k,
            axis_name,
            leader=self.leader,
            step=step,
            selector=self.selector,
            sparse_sent=sparse,
            scatter=True,
        )

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        """What :meth:`wire_bytes` counts: the exchange is the same, only the adding differs."""
        if not self.scatters:
            return super().reduce_scatter_bytes(n, n_devices, dtype_bytes=dtype_bytes)
        return self.wire_bytes(n, n_devices, dtype_bytes=dtype_bytes)

    def reduce_scatter_steps(self, n_devices):
        if not self.scatters:
            return super().reduce_scatter_steps(n_devices)
        return self.message_steps(n_devices)

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """Bytes per device (``N = n_devices``, ``d = dtype_bytes``, indices 4 bytes):

        * ``"allgather"``: an all-gather of ``k`` values and ``k`` indices, ``(N-1) k (d+4)``;
          with ``value_bits`` (``b``, ``c = value_chunk``) of ``k`` indices, ``ceil(k / (32 // b))``
          words of packed codes and ``ceil(k / c)`` float32 scales,
          ``(N-1) 4 (k + ceil(k / (32 // b)) + ceil(k / c))``.
        * ``"ar"``: an all-reduce of ``k`` leader-masked int32 indices, then one of ``k`` values,
          both costed as ``allreduce``; VAR adds the all-gather of one float32 norm per device.
          SPLIT (``e = ceil(k/N)``): an all-gather of ``e`` int32 indices, ``(N-1) 4e``, then the
          all-reduce of ``N e`` values.
        * ``"hierarchical"`` (``I = inner_size``, ``O = N / I``, ``s = ceil(n/I)``,
          ``k_s = ceil(k/I)``): ring reduce-scatter in the node ``(I-1) s d``, all-gather of
          ``k_s`` pairs across nodes ``(O-1) k_s (d+4)``, and of ``O k_s`` pairs in the node
          ``(I-1) O k_s (d+4)``.
        """
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices, inner_size)
        k = self.kept(n)
        pair = dtype_bytes + sizes.INDEX_BYTES
        if self.collective == "allgather" and self.value_bits is not None:
            words = sizes.coded_pairs_words(k, self.value_bits, self.value_chunk)
            return float((N - 1) * words * sizes.WORD_BYTES)
        if self.collective == "allgather":
            return float((N - 1) * k * pair)
        if self.collective == "ar":
            if N == 1:
                return 0.0
            if self.leader == "split":
                each = sizes.ceil_div(k, N)
                values = sizes.allreduce_bytes(N * each * dtype_bytes, N, self.allreduce)
                return float((N - 1) * each * sizes.INDEX_BYTES) + values
            total = sizes.allreduce_bytes(
                k * sizes.INDEX_BYTES, N, self.allreduce
            ) + sizes.allreduce_bytes(k * dtype_bytes, N, self.allreduce)
            return total + ((N - 1) * sizes.SCALAR_BYTES if self.leader == "var" else 0.0)
        inner = self._inner(N, inner_size)
        outer = N // inner
        shard, k_shard = sizes.hierarchical_shard(n, k, inner)
        return float(
            (inner - 1) * shard * dtype_bytes
            + (outer - 1) * k_shard * pair
            + (inner - 1) * outer * k_shard * pair
        )

    def message_steps(self, n_devices, *, inner_size=None):
        """``"allgather"``: ``ceil(log2 N)`` (recursive doubling); ``"ar"``: two all-reduces
        (``4(N-1)`` as rings, ``4 ceil(log2 N)`` as trees), SPLIT one all-gather and one
        all-reduce; ``"hierarchical"``:
        ``(I-1) + ceil(log2(N/I)) + ceil(log2 I)``."""
        N = _checks.check_devices(n_devices, inner_size)
        if N == 1:
            return 0
        if self.collective == "allgather":
            return sizes.log2_steps(N)
        if self.collective == "ar":
            values = sizes.allreduce_steps(N, self.allreduce)
            if self.leader == "split":
                return sizes.log2_steps(N) + values
            return 2 * values
        inner = self._inner(N, inner_size)
        return (inner - 1) + sizes.log2_steps(N // inner) + sizes.log2_steps(inner)

    def _inner(self, n_devices, inner_size):
        if inner_size is None:
            raise ValueError(f"inner_size (devices per node) is required for {self.label}")
        return inner_size

    def local_work(self, n_values, n_devices):
        import jax.numpy as jnp

        from jaxcomp.ops.topk import merged_indices, threshold_topk, topk

        k = self.kept(n_values)
        select = topk if self.selector == "exact" else threshold_topk
        if self.value_bits is not None:
            return self._coded_work(k, select)
        if self.collective == "ar" and self.leader == "split":  # (the default leader of all)
            each = sizes.ceil_div(k, n_devices)

            def split_codec(x):
                # This device's k/N, then the merge of the N k/N gathered indices (this device's
                # N times stand in for them) and the error feedback at every one.
                mine = select(x, each)[1]
                shared = merged_indices(jnp.tile(mine, (n_devices, 1)), x.shape[0])
                return x.at[shared].set(0.0, mode="drop")

            return split_codec

        def codec(x):
            values, indices = select(x, k)
            return x.at[indices].add(-values)  # the selection and the in-place error feedback

        return codec

    def _coded_work(self, k, select):
        """The all-gather's local work with low-bit values: the selection, coding and decoding
        this device's values (the others' decode alike), and the in-place error feedback."""
        from jaxcomp.collectives.value_codes import decode_values, encode_values

        bits, chunk = self.value_bits, self.value_chunk

        def codec(x):
            values, indices = select(x, k)
            decoded = decode_values(*encode_values(values, bits, chunk), bits, chunk, k)
            return x.at[indices].add(-decoded.astype(x.dtype))

        return codec
