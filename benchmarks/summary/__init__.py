"""BENCHMARKS.md's sections, one module each: ``FILES`` (the result files it reads) and
``section()`` (its Markdown), which ``benchmarks/report.py`` writes between the file's markers."""
