"""What the commands share to show their results: a progress bar, tables, and plots written safely.

Every ``jaxcomp`` command that reports (``demo``, ``advise``, ``kernels``, ``netbench``) draws its
progress, its tables and its figures through these helpers, so that they look alike and check a
plot's path the same way: before any work, not after minutes of it.
"""

from __future__ import annotations

import os
import platform
import sys


def machine() -> str:
    """The machine a result was measured on, for its record: the host's name, its CPU model (the
    same command runs at other speeds on another CPU), its cores and jax's version."""
    import jax

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    return f"{platform.node()}: {model}, {os.cpu_count()} cores, jax {jax.__version__}"


class _PlainBar:
    """What :func:`progress_bar` gives without tqdm: plain iteration; descriptions to stderr if
    enabled."""

    def __init__(self, iterable, enabled):
        self._iterable = () if iterable is None else iterable
        self._enabled = enabled

    def __iter__(self):
        return iter(self._iterable)

    def set_description(self, text):
        if self._enabled:
            print(text, file=sys.stderr, flush=True)

    def update(self, n=1):
        pass

    def close(self):
        pass


def progress_bar(iterable=None, *, enabled=True, **options):
    """A tqdm progress bar on stderr, or plain iteration when disabled or tqdm is not installed.

    Args:
      iterable: what to iterate over (None: a bar driven by ``update``, with ``total=`` in
        ``options``).
      enabled: False gives plain iteration and no output at all.
      **options: passed to ``tqdm`` (``desc``, ``total``, ``unit``, ``leave``, ``mininterval``).

    Returns:
      An iterable with ``set_description(text)``, ``update(n)`` and ``close()``; without tqdm,
      ``set_description`` prints the text on stderr (when enabled).

    Example:
      >>> list(progress_bar(range(3), enabled=False))
      [0, 1, 2]
    """
    if not enabled:
        return _PlainBar(iterable, False)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the progress bar is optional
        return _PlainBar(iterable, True)
    return tqdm(iterable, file=sys.stderr, **options)


def format_table(header, rows, *, align=None, markdown=True) -> str:
    """Rows of cells as a Markdown table, or as a plain table of aligned columns.

    Args:
      header: the column titles.
      rows: lists of cells (strings), one list per row.
      align: Markdown only: one letter per column, ``"l"`` or ``"r"`` (default: all left).
      markdown: False for columns padded with spaces, under a line of dashes.

    Returns:
      The table, one line per row after the header (and its separator line).

    Example:
      >>> print(format_table(["a", "b"], [["1", "22"]], align="lr"))
      | a | b |
      |---|---:|
      | 1 | 22 |
    """
    if markdown:
        align = align or "l" * len(header)
        lines = ["| " + " | ".join(header) + " |"]
        lines.append("|" + "".join("---:|" if a == "r" else "---|" for a in align))
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(cells[i]) for cells in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(c) for c in rows])


def unwritable_file(path, formats=None) -> str | None:
    """Why a file (a plot, a JSON) cannot be written at ``path``, or None; checked before any work.

    Args:
      path: the file to write.
      formats: the image formats allowed, by suffix (e.g. ``("png", "pdf")``); None: any name.

    Returns:
      The reason in a few words, or None when it can be written.

    Example:
      >>> unwritable_file("/nonexistent/plot.png")
      'the folder /nonexistent does not exist'
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a folder; name the image file, e.g. speedup.png"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file exists and is not writable"
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if formats is not None and suffix not in formats:
        return (
            f"the name must end in one of {', '.join('.' + f for f in formats)} (the image format)"
        )
    return None


def unwritable_folder(path) -> str | None:
    """Why ``path`` cannot become a folder to write into (it is created if missing), or None.

    Args:
      path: the folder.

    Returns:
      The reason in a few words, or None when files can be written there.

    Example:
      >>> import tempfile
      >>> unwritable_folder(tempfile.gettempdir()) is None
      True
    """
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a folder"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        return f"cannot create the folder ({error.strerror or error})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "the folder is not writable"
    return None


def pyplot():
    """matplotlib's ``pyplot`` drawing to files only (the Agg backend: no display needed).

    Returns:
      The ``matplotlib.pyplot`` module.

    Example:
      >>> figure, axes = pyplot().subplots()  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path, dpi) -> None:
    """Lays ``figure`` out, writes it to ``path`` and frees it.

    Args:
      figure: a matplotlib figure.
      path: the image file (its suffix picks the format).
      dpi: dots per inch.

    Example:
      >>> save_figure(pyplot().figure(), "plot.png", dpi=120)  # doctest: +SKIP
    """
    if figure.get_layout_engine() is None:  # a constrained layout lays itself out
        figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)


#: Line styles that stay apart in print and in grey scale; with :data:`_COLORS`, no two of the
#: first ``len(_COLORS)`` lines of a panel look alike.
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
#: matplotlib's colour-blind-friendly "tab10" without its grey (black is the reference line).
_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
)


def distinct_styles(n) -> list[dict]:
    """Keyword arguments for ``Axes.plot`` that give ``n`` lines distinct colours and line styles.

    Args:
      n: the number of lines in one panel.

    Returns:
      ``n`` dicts with ``color``, ``linestyle`` and ``marker``: line ``i`` takes colour ``i``,
      line style ``i`` and marker ``i`` (each cycling), so neighbours differ in all three.

    Example:
      >>> [style["linestyle"] for style in distinct_styles(3)]
      ['-', '--', '-.']
    """
    return [
        {
            "color": _COLORS[i % len(_COLORS)],
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
        }
        for i in range(n)
    ]


def log_ticks_1_2_5(axis) -> None:
    """Labels a log-scale axis at 1, 2 and 5 times the powers of ten, in plain numbers (``0.2``,
    ``1``, ``50``; no ``2×10⁻¹``), without minor labels.

    Args:
      axis: a matplotlib ``Axis`` on a log scale (``ax.yaxis``).

    Example:
      >>> figure, axes = pyplot().subplots()  # doctest: +SKIP
      >>> axes.set_yscale("log"); log_ticks_1_2_5(axes.yaxis)  # doctest: +SKIP
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}"))
    axis.set_minor_formatter(NullFormatter())


def write_csv(path, header, rows) -> None:
    """Writes a table as CSV (RFC 4180 quoting), one row per line after the header.

    Args:
      path: the file.
      header: the column titles.
      rows: lists of cells (numbers or strings), one list per row.

    Example:
      >>> write_csv("table.csv", ["a", "b"], [[1, "x, y"]])  # doctest: +SKIP
    """
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
