"""Compression methods: one object per method, owning everything about it.

============================  ===================================================================
:class:`Dense`                the plain all-reduce (:func:`jaxcomp.collectives.psum`)
:class:`TopK`                 top-k sparsification:
                              ``collective="allgather" | "ar" | "hierarchical"``
:class:`Zfp`                  ZFP fixed-rate compression in a ring (or recursive-doubling)
                              all-reduce
:class:`Quantized`            THC homomorphic quantization, one integer all-reduce
:class:`RandomK`              random-k at indices every device draws from one seed, one all-reduce
:class:`Cast`                 the gradient all-reduced in bfloat16 or float16
:class:`PowerSGD`             rank-r factors of each matrix by a warm-started power iteration, two
                              all-reduces
:class:`Sign`                 1-bit signs and a scale per chunk (EF-SignSGD), or signSGD's majority
                              vote
============================  ===================================================================

Every method is a :class:`Method` (the protocol, in :mod:`jaxcomp.methods.base`); a method defined
outside jaxcomp works in :func:`jaxcomp.compress`, :func:`jaxcomp.compress_auto`, the cost model
and ``jaxcomp advise`` alike. :data:`SHORTHAND` is the one table of method names: it lets
``jaxcomp.compress("ar_topk", ratio=0.01)`` and the command lines name a method by string.
Importing this package loads no JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil

from jaxcomp.methods.base import Method, scattering  # noqa: F401  (public: jaxcomp.methods.scattering)
from jaxcomp.methods.cast import Cast
from jaxcomp.methods.dense import Dense
from jaxcomp.methods.powersgd import PowerSGD
from jaxcomp.methods.quantized import Quantized
from jaxcomp.methods.randomk import RandomK
from jaxcomp.methods.sign import Sign
from jaxcomp.methods.topk import TopK
from jaxcomp.methods.zfp import Zfp


def _discover() -> dict:
    """Every :class:`Method` subclass defined in a module of this package, by module name order;
    a new method is one new module (and its test), listed nowhere else."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, Method)
                and obj.__module__ == module.__name__
            ):
                found[obj.__name__] = obj
    return found


def _shorthand(classes) -> dict:
    """The string names of ``classes`` (their ``shorthand``), refusing a name given twice."""
    table = {}
    for cls in classes:
        for name, fixed in cls.shorthand.items():
            if name in table:
                raise ImportError(f"method name {name!r} is claimed twice ({cls.__name__})")
            table[name] = functools.partial(cls, **fixed) if fixed else cls
    return table


_METHODS = _discover()
globals().update({name: cls for name, cls in _METHODS.items() if name not in globals()})

#: Method names for :func:`parse`, from every method's ``shorthand``: each builds a method from its
#: options (``ratio=``, ``rate=``, ...). The ``*_ring`` names are the cost model's former names of
#: the same methods.
SHORTHAND = _shorthand(_METHODS.values())

#: What each required option of the string form means, for error messages.
_OPTION_HELP = {
    "rate": "rate= (bits per value, an integer in [1, 32], e.g. 8)",
    "bits": "bits= (bits per value, an integer in [1, 16], e.g. 8)",
}


def parse(method, *, strict: bool = True, **options) -> Method:
    """A :class:`Method` from a name in :data:`SHORTHAND` and its options, or ``method`` itself.

    Options that are ``None`` count as not given, so callers can pass their keyword arguments
    through.

    Args:
      method: a :class:`Method`, or a name such as ``"ar_topk"``, ``"zfp"``, ``"dense_tree"``.
      strict: refuse options the named method does not take (default); with False they are
        dropped, so one set of options can serve several names (the cost model's ``ratio=``).
      **options: the method's constructor arguments (``ratio=``, ``k=``, ``rate=``, ``bits=``,
        ``leader=``, ``selector=``, ``algorithm=``, ``hadamard=``, ``allreduce=``,
        ``value_bits=``).

    Returns:
      The method object.

    Example:
      >>> from jaxcomp import methods
      >>> methods.parse("ar_topk", ratio=0.01) == methods.TopK(0.01, collective="ar")
      True
      >>> methods.parse("allgather_topk", ratio=0.02, value_bits=2).describe()
      'allgather_topk_2bit(0.02)'
      >>> methods.parse(methods.Zfp(8)) == methods.Zfp(8)
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I (the methods and their variants).
    """
    options = {name: value for name, value in options.items() if value is not None}
    if isinstance(method, Method):
        if options and strict:
            raise ValueError(
                f"{', '.join(f'{name}=' for name in options)} goes with a method name; a method "
                f"object carries its own settings: {method!r}"
            )
        return method
    if not isinstance(method, str):
        raise TypeError(
            f"method must be a jaxcomp.methods.Method or one of {tuple(SHORTHAND)}, got "
            f"{type(method).__name__}"
        )
    if method not in SHORTHAND:
        raise ValueError(
            f"method must be a jaxcomp.methods.Method or one of {tuple(SHORTHAND)}, got {method!r}"
        )
    build = SHORTHAND[method]
    cls = build.func if isinstance(build, functools.partial) else build
    fixed = build.keywords if isinstance(build, functools.partial) else {}
    accepted = {field.name for field in dataclasses.fields(cls)} - set(fixed)
    extra = sorted(set(options) - accepted)
    if not strict:
        options = {name: value for name, value in options.items() if name in accepted}
    elif extra:
        wanted = " or ".join(f"{name}=" for name in sorted(accepted)) or "nothing else"
        raise ValueError(
            f"method {method!r} takes {wanted}; remove {', '.join(f'{name}=' for name in extra)}"
        )
    missing = [
        field.name
        for field in dataclasses.fields(cls)
        if field.name in accepted
        and field.default is dataclasses.MISSING
        and field.default_factory is dataclasses.MISSING
        and field.name not in options
    ]
    if missing:
        raise ValueError(
            f"method {method!r} needs {_OPTION_HELP.get(missing[0], missing[0] + '=')}"
        )
    try:
        return build(**options)
    except ValueError as e:  # the method's own check, said of the name the caller used
        raise ValueError(f"method {method!r}: {e}") from None


def candidates(
    *,
    ratio=None,
    rate=None,
    bits=None,
    rank=None,
    hierarchical: bool = False,
    variants: bool = False,
    sign=None,
) -> tuple[Method, ...]:
    """The methods the given settings allow, dense first: what ``compress_auto`` and ``advise`` try
    by default.

    Args:
      ratio: density of the top-k methods (all-gather and AR-Topk), or None to leave them out.
      rate: ZFP bits per value, or None to leave ZFP out.
      bits: THC code width, or None to leave it out.
      rank: PowerSGD's rank, or None to leave it out.
      hierarchical: also hierarchical top-k (needs two mesh axes; with ``ratio``).
      variants: also the cost model's variants (tree all-reduces, ZFP's recursive doubling),
        random-k, the bfloat16 cast and the scaled signs (all-gathered, all-reduced and in a
        ring, chunk ``sign`` or 1024): what the advisor compares.
      sign: values per scale of the scaled-sign methods (:class:`Sign`, all-gathered,
        all-reduced and in a ring), or None to leave them out (``variants`` still adds them).

    Returns:
      A tuple of methods.

    Example:
      >>> [m.describe() for m in candidates(ratio=0.01, rate=8)]
      ['dense', 'allgather_topk(0.01)', 'ar_topk(0.01)', 'zfp(8)']

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D (the candidates flexible communication picks from).
    """
    out = [Dense()] + ([Dense(allreduce="tree")] if variants else [])
    if ratio is not None:
        out += [TopK(ratio, collective="allgather"), TopK(ratio, collective="ar")]
        out += [TopK(ratio, collective="ar", allreduce="tree")] if variants else []
        out += [TopK(ratio, collective="hierarchical")] if hierarchical else []
        out += [RandomK(ratio)] if variants else []
    if rate is not None:
        out += [Zfp(rate)] + ([Zfp(rate, algorithm="recursive_doubling")] if variants else [])
    if bits is not None:
        out.append(Quantized(bits))
    if rank is not None:
        out.append(PowerSGD(rank))
    out += [Cast("bfloat16")] if variants else []
    if sign is not None or variants:
        chunk = {} if sign is None else {"chunk": sign}
        out += [Sign(**chunk, aggregation=how) for how in ("allgather", "allreduce", "ring")]
    return tuple(out)


#: What ``compress("auto")`` chooses among when no setting names a method: the methods that keep
#: ``optax.adam``'s held-out loss on the quality benchmark (docs/training.md, "Automatic choice").
#: Top-k, THC and PowerSGD send less but lose quality with a plain optimizer.
QUALITY_SAFE = (Dense(), Cast("bfloat16"), Zfp(8))

__all__ = [
    "Cast",
    "Dense",
    "Method",
    "PowerSGD",
    "QUALITY_SAFE",
    "Quantized",
    "RandomK",
    "SHORTHAND",
    "Sign",
    "TopK",
    "Zfp",
    "candidates",
    "parse",
]
