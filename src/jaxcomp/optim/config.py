"""The arguments every error-feedback transformation shares, validated: :class:`FeedbackConfig`."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from jaxcomp.ops import _checks
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.stages import mask as mask_stage
from jaxcomp.optim.state import NONFINITE_POLICIES

#: How gradients are grouped before compression: the whole model as one vector, or leaf by leaf.
GRANULARITIES = ("model", "leaf")


#: ``bucket_mb="auto"`` (``compress``'s default): buckets of this many MiB (PyTorch DDP's
#: ``bucket_cap_mb``) for a method whose result buckets do not change but for the order of its
#: roundings (:attr:`jaxcomp.methods.Method.buckets_by_default`: dense and the casts); one message
#: for the methods that select or code, where a bucket's own selection changes what is sent and
#: the gain in speed is mixed (docs/performance.md, "Overlapping the backward pass").
DEFAULT_BUCKET_MB = 25.0


class _Unset:
    """The default of a deprecated keyword, told apart from any value a caller passes."""

    def __repr__(self) -> str:
        return "<unset>"


#: The default of :data:`DEPRECATED_KEYWORDS`' keywords in the signatures.
UNSET = _Unset()

#: ``compress``'s and ``compress_auto``'s keywords that no benchmark, guide or user passed (the
#: survey in docs/notes/2026-12-05-stages-as-transformations.md): their value from now on, and
#: what to do instead. They keep working until jaxcomp 0.3, with a ``DeprecationWarning``.
DEPRECATED_KEYWORDS = {
    "mean": (
        True,
        "the update is the mean over the devices; for their sum, chain optax.scale(n_devices) "
        "after it",
    ),
    "seed": (0, "the state's PRNG key is seeded with 0 (each step draws from fold_in(key, step))"),
}


def deprecated_keywords(entry: str, stacklevel: int, **given) -> tuple:
    """Deprecated keywords' values: each one's default where the caller left it out, else the
    value given, with a ``DeprecationWarning`` that says what to do instead.

    Args:
      entry: the function the caller called, for the message.
      stacklevel: the caller's frame, counted from the function that calls this one.
      **given: each keyword of :data:`DEPRECATED_KEYWORDS` and what the caller passed
        (:data:`UNSET` when nothing).

    Returns:
      The values to use, in the order given.

    Example:
      >>> deprecated_keywords("compress", 1, mean=UNSET, seed=UNSET)
      (True, 0)

    References:
      PEP 565 (DeprecationWarning shown where the caller's code passes the keyword).
    """
    values = []
    for name, value in given.items():
        default, instead = DEPRECATED_KEYWORDS[name]
        if value is not UNSET:
            warnings.warn(
                f"{entry}({name}=) is deprecated and will be removed in jaxcomp 0.3: {instead}",
                DeprecationWarning,
                stacklevel=stacklevel + 1,
            )
        values.append(default if value is UNSET else value)
    return tuple(values)


def default_buckets(bucket_mb, by_default: bool):
    """``bucket_mb`` with ``"auto"`` resolved for a method.

    Args:
      bucket_mb: ``compress``'s ``bucket_mb=``: ``"auto"``, a size in MiB or None.
      by_default: the method's :attr:`jaxcomp.methods.Method.buckets_by_default`.

    Returns:
      :data:`DEFAULT_BUCKET_MB` for ``"auto"`` and a method bucketed by default, None for
      ``"auto"`` and any other method; anything else as given (:meth:`FeedbackConfig.check`
      checks it).

    Example:
      >>> default_buckets("auto", True), default_buckets("auto", False), default_buckets(4, False)
      (25.0, None, 4)

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020 (gradient buckets, 25 MB by default).
    """
    if isinstance(bucket_mb, str) and bucket_mb == "auto":
        return DEFAULT_BUCKET_MB if by_default else None
    return bucket_mb


def default_feedback(error_feedback, methods):
    """``error_feedback`` with ``"auto"`` resolved for the methods a transformation may run.

    Args:
      error_feedback: ``compress``'s ``error_feedback=``: ``"auto"``, True, False or a decay.
      methods: the :class:`jaxcomp.methods.Method` objects (one, or ``compress_auto``'s
        candidates).

    Returns:
      For ``"auto"``: True when any of ``methods`` that loses something (not
      :attr:`~jaxcomp.methods.Method.sends_everything`, as dense does) feeds back by default
      (:attr:`jaxcomp.methods.Method.feeds_back_by_default`; every method but the casts), False
      otherwise; anything else as given (:meth:`FeedbackConfig.check` checks it).

    Example:
      >>> from jaxcomp.methods import Cast, Dense, TopK
      >>> default_feedback("auto", [Dense(), Cast()]), default_feedback("auto", [TopK(0.01)])
      (False, True)

    References:
      Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
      Distributed Training of Speech DNNs", Interspeech 2014 (error feedback); Karimireddy et
      al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
    """
    if isinstance(error_feedback, str) and error_feedback == "auto":
        return any(
            getattr(m, "feeds_back_by_default", True) and not getattr(m, "sends_everything", False)
            for m in methods
        )
    return error_feedback


def _feedback_decay(error_feedback) -> tuple[bool, float]:
    """``(on, decay)`` of ``error_feedback=``: True/False (decay 1), or a decay in (0, 1) that
    turns it on (SparseLoCo's: ``r <- decay r + g`` before the compression)."""
    if isinstance(error_feedback, (bool, np.bool_)):
        return bool(error_feedback), 1.0
    number = isinstance(error_feedback, (int, float, np.floating)) and not isinstance(
        error_feedback, (bool, np.bool_)
    )
    if not number or not 0 < error_feedback < 1:
        raise TypeError(
            "error_feedback must be True, False, 'auto' or a decay in (0, 1) (e.g. 0.95: the "
            f"residual is scaled by it each step), got {error_feedback!r}"
        )
    return True, float(error_feedback)


def _check_bucket_mb(bucket_mb) -> float | None:
    """``bucket_mb`` as a float, or None; a ValueError naming it unless it is None or > 0."""
    if bucket_mb is None:
        return None
    number = isinstance(bucket_mb, (int, float, np.number)) and not isinstance(bucket_mb, bool)
    if not number or not np.isfinite(bucket_mb) or bucket_mb <= 0:
        raise ValueError(
            f"bucket_mb must be a size in MiB > 0 (e.g. 25), 'auto' or None, got {bucket_mb!r}"
        )
    return float(bucket_mb)


@dataclasses.dataclass(frozen=True)
class FeedbackConfig:
    """The validated arguments every error-feedback transformation shares (see :func:`compress`)."""

    axes: tuple[str, ...]
    error_feedback: bool = True
    granularity: str = "model"
    mean: bool = True
    seed: int = 0
    nonfinite: str = "zero"
    mask: Any = dataclasses.field(
        default=None, compare=False
    )  # None, a pytree of bools or a callable
    min_size: int = 0
    momentum: float | None = None  # DGC's momentum correction
    guardrail: divergence.Guardrail | None = None  # the divergence guardrail, None when off
    bucket_mb: float | None = None  # buckets overlapping the backward pass, None: one at the end
    decay: float = 1.0  # error feedback's residual is scaled by it before it is added
    # Per branch, the bucket_mb and the error feedback of a step compiled for that branch alone
    # (compress_auto's "auto": each candidate's own default); None: the fields above for all.
    branch_buckets: tuple | None = None
    branch_feedback: tuple | None = None

    @property
    def axis_name(self):
        """The axis, or the tuple of axes, the collectives reduce over."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @classmethod
    def check(
        cls,
        axis_name,
        error_feedback,
        granularity,
        mean,
        seed,
        nonfinite,
        mask=None,
        min_size=0,
        momentum=None,
        guardrail=None,
        bucket_mb=None,
    ) -> FeedbackConfig:
        """Validates the shared arguments, naming the one that is wrong."""
        axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        if (
            not axes
            or not all(isinstance(a, str) and a for a in axes)
            or len(set(axes)) != len(axes)
        ):
            raise ValueError(
                f"axis_name must be a mesh axis name or a tuple of distinct ones, got {axis_name!r}"
            )
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be 'model' or 'leaf', got {granularity!r}")
        error_feedback, decay = _feedback_decay(error_feedback)
        if not isinstance(mean, (bool, np.bool_)):
            raise TypeError(f"mean must be True or False, got {mean!r}")
        seed = _checks.static_int(
            seed, "seed", 0, 2**32 - 1
        )  # PRNGKey keeps 32 bits: 2**32 would be seed 0
        if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite must be one of {NONFINITE_POLICIES} (what to do with NaN/Inf gradient "
                f"entries), got {nonfinite!r}"
            )
        min_size = _checks.static_int(min_size, "min_size", 0)
        if momentum is not None:
            if (
                isinstance(momentum, bool)
                or not isinstance(momentum, (int, float))
                or not 0 <= momentum < 1
            ):
                raise ValueError(
                    f"momentum_correction must be a momentum in [0, 1) (e.g. 0.9) or None, got "
                    f"{momentum!r}"
                )
            momentum = float(momentum)
        return cls(
            axes=axes,
            error_feedback=bool(error_feedback),
            granularity=granularity,
            mean=bool(mean),
            seed=seed,
            nonfinite=nonfinite,
            mask=mask,
            min_size=min_size,
            momentum=momentum,
            guardrail=divergence.check(guardrail),
            bucket_mb=_check_bucket_mb(bucket_mb),
            decay=decay,
        )

    def for_branch(self, branch: int | None) -> FeedbackConfig:
        """This config as a step compiled for ``branch`` alone runs it: with that branch's own
        buckets and error feedback (:attr:`branch_buckets`, :attr:`branch_feedback`); itself
        for None (the device chooses the branch).

        Args:
          branch: an index into the transformation's branches, or None.

        Returns:
          A :class:`FeedbackConfig`.

        Example:
          >>> c = FeedbackConfig(("data",), branch_buckets=(25.0, None))
          >>> c.for_branch(0).bucket_mb, c.for_branch(1).bucket_mb, c.for_branch(None).bucket_mb
          (25.0, None, None)

        References:
          Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3 (gradient buckets).
        """
        if branch is None:
            return self
        own = {}
        if self.branch_buckets is not None:
            own["bucket_mb"] = self.branch_buckets[branch]
        if self.branch_feedback is not None:
            own["error_feedback"] = self.branch_feedback[branch]
        return dataclasses.replace(self, **own, branch_buckets=None, branch_feedback=None)

    def compressed(self, tree) -> list[bool]:
        """Per leaf of ``tree`` (params or gradients): whether ``mask`` and ``min_size`` let it be
        compressed (:func:`jaxcomp.optim.stages.mask.compressed_leaves`)."""
        return mask_stage.compressed_leaves(self.mask, self.min_size, tree)
