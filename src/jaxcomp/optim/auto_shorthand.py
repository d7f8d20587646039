"""``compress("auto", ...)``: :func:`jaxcomp.compress_auto` from method names and settings."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxcomp import methods
from jaxcomp.costmodel import ratio_choice
from jaxcomp.optim.auto import (
    DEFAULT_DECIDE_EVERY,
    DEFAULT_EXPLORE_STEPS,
    RatioSearch,
    compress_auto,
)

# The option names of compress("auto", ...) that set candidates' settings, and the auto-only ones.
_SETTING_OPTIONS = ("ratio", "rate", "bits", "rank", "leader", "selector", "algorithm", "hadamard")


def compress_auto_shorthand(
    *,
    candidates=None,
    ratio=None,
    k=None,
    rate=None,
    bits=None,
    adaptive_ratio=None,
    ratio_range=None,
    explore_steps=None,
    network=None,
    decide_every=None,
    axis_name="data",
    **options,
):
    """``compress("auto", ...)``: :func:`compress_auto` from method names and settings.

    Args:
      candidates: method names from :data:`jaxcomp.methods.SHORTHAND`, or None for
        :func:`jaxcomp.methods.candidates` of the settings (:data:`jaxcomp.methods.QUALITY_SAFE`
        without ``ratio``, ``rate``, ``bits``, ``rank`` or ``adaptive_ratio``).
      ratio: density of the top-k candidates (not with ``adaptive_ratio``).
      k: refused: the cost model sizes top-k by ratio.
      rate: ZFP bits per value.
      bits: THC bits.
      adaptive_ratio: search the ratio (:class:`RatioSearch` over ``ratio_range`` with
        ``explore_steps``).
      ratio_range: with ``adaptive_ratio``: ``(low, high)``.
      explore_steps: with ``adaptive_ratio``: steps per candidate ratio.
      network: as for :func:`compress_auto`.
      decide_every: as for :func:`compress_auto`.
      axis_name: as for :func:`compress_auto`.
      **options: ``rank=`` (adds PowerSGD), ``leader=``, ``selector=``, ``algorithm=``,
        ``hadamard=`` for the candidates that take them, and :func:`compress_auto`'s own keywords.

    Returns:
      What :func:`compress_auto` returns.

    Example:
      >>> import jaxcomp
      >>> state = jaxcomp.compress("auto", ratio=0.01).init({})
      >>> [m.describe() for m in state.methods]
      ['dense', 'allgather_topk(0.01)', 'ar_topk(0.01)']
      >>> [m.describe() for m in jaxcomp.compress("auto").init({}).methods]
      ['dense', 'bf16', 'zfp(8)']

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D and §3-E.
    """
    if k is not None:
        raise ValueError(
            "method 'auto' sizes top-k by ratio= (its cost model is per ratio); pass ratio= "
            "instead of k="
        )
    search, ratio = _ratio_search_of(ratio, adaptive_ratio, ratio_range, explore_steps)
    axes = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    settings = _settings(ratio, rate, bits, options)
    names, built = _candidates(candidates, settings, two_axes=len(axes) == 2)
    _check_settings_used(settings, names, built)
    return compress_auto(
        built,
        axis_name=axis_name,
        ratio_search=search,
        network=network,
        decide_every=DEFAULT_DECIDE_EVERY if decide_every is None else decide_every,
        **options,
    )


def _settings(ratio, rate, bits, options: dict) -> dict:
    """The candidates' settings given (popped from ``options``), checked."""
    settings = {
        "ratio": ratio,
        "rate": rate,
        "bits": bits,
        **{name: options.pop(name) for name in _SETTING_OPTIONS if name in options},
    }
    settings = {name: value for name, value in settings.items() if value is not None}
    if settings.get("algorithm") not in (None, "ring"):
        raise ValueError(
            "method 'auto' runs zfp with algorithm='ring': the recursive-doubling total is typed "
            "varying and the branches must agree; remove algorithm="
        )
    return settings


def _candidates(candidates, settings: dict, two_axes: bool) -> tuple[list, list]:
    """The candidates' names and methods: those named, or those the settings ask for."""
    if candidates is None and not {"ratio", "rate", "bits", "rank"} & set(settings):
        # Nothing asked for: the candidates that keep a plain optimizer's quality.
        built = list(methods.QUALITY_SAFE)
        return [m.label for m in built], built
    names = _candidate_names(candidates, settings, two_axes=two_axes)
    return names, [methods.parse(name, strict=False, **settings) for name in names]


def _ratio_search_of(ratio, adaptive_ratio, ratio_range, explore_steps):
    """``(RatioSearch or None, ratio)`` of the shorthand's ratio options, checked."""
    if adaptive_ratio is None:
        adaptive_ratio = False
    if not isinstance(adaptive_ratio, (bool, np.bool_)):
        raise TypeError(f"adaptive_ratio must be True or False, got {adaptive_ratio!r}")
    if not adaptive_ratio:
        for name, value in (("ratio_range", ratio_range), ("explore_steps", explore_steps)):
            if value is not None:
                raise ValueError(
                    f"{name}= applies with adaptive_ratio=True only; remove it or set "
                    "adaptive_ratio=True"
                )
        return None, ratio
    if ratio is not None:
        raise ValueError("adaptive_ratio=True chooses the ratio from ratio_range=; remove ratio=")
    search = RatioSearch(
        ratio_choice.DEFAULT_RATIO_RANGE if ratio_range is None else ratio_range,
        DEFAULT_EXPLORE_STEPS if explore_steps is None else explore_steps,
    )
    return search, search.ratios[0]


def _candidate_names(candidates, settings: dict, two_axes: bool) -> list[str]:
    """The shorthand's candidate names: given, or :func:`jaxcomp.methods.candidates` of the
    settings."""
    if candidates is None:
        picked = methods.candidates(
            ratio=settings.get("ratio"),
            rate=settings.get("rate"),
            bits=settings.get("bits"),
            rank=settings.get("rank"),
            hierarchical=two_axes,
        )
        return [m.label for m in picked]
    if isinstance(candidates, str) or not all(isinstance(m, str) for m in candidates):
        raise TypeError(f"candidates must be a sequence of method names, got {candidates!r}")
    names = list(candidates)
    if not names or len(set(names)) != len(names) or not set(names) <= set(methods.SHORTHAND):
        raise ValueError(
            f"candidates must be distinct method names from {tuple(methods.SHORTHAND)}, "
            f"got {tuple(names)!r}"
        )
    return names


def _check_settings_used(settings: dict, names, built) -> None:
    """Refuses a setting that none of the candidates takes."""
    for option in settings:
        takes = [
            name
            for name, m in zip(names, built)
            if option in {f.name for f in dataclasses.fields(m)}
        ]
        if not takes:
            raise ValueError(
                f"{option}= goes with none of the candidates {tuple(names)!r}; remove it or add a "
                "candidate that takes it"
            )
